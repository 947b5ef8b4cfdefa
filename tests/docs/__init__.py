"""The docs' snippets, the API reference and the site build; the examples as written."""
