"""Build script: the metadata lives in setup.cfg; this file only adds the optional
C extension ``feeder.decode._jpeg`` (region + scaled JPEG decoding with the system's
libjpeg-turbo, see feeder/decode/_jpeg.c).

The extension is optional: without a C compiler or libjpeg's headers the build
prints why, skips it and installs feeder anyway, which then decodes JPEGs with
simplejpeg (a full decode before every crop). Set FEEDER_NO_JPEG_EXT_BUILD=1 to
skip it on purpose.
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that warns and goes on when an extension cannot be built."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # no compiler at all (distutils raises its own classes)
            self._skip(exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # a missing header (jpeglib.h), a failed link
            self._skip(exc)

    @staticmethod
    def _skip(exc):
        sys.stderr.write(
            f"feeder: not building the optional JPEG region decoder ({type(exc).__name__}: {exc}); "
            "feeder will decode JPEGs with simplejpeg. For the faster path install libjpeg-turbo's "
            "headers and a C compiler (apt-get install gcc libjpeg-dev / libjpeg62-turbo-dev, "
            "dnf install gcc libjpeg-turbo-devel, or conda install libjpeg-turbo) and reinstall.\n")


extensions = []
if os.environ.get("FEEDER_NO_JPEG_EXT_BUILD", "") in ("", "0"):
    prefix = os.environ.get("CONDA_PREFIX")
    extensions.append(Extension(
        "feeder.decode._jpeg", ["feeder/decode/_jpeg.c", "feeder/decode/_huffman.c", "feeder/decode/_resize.c"], libraries=["jpeg", "dl", "m"] if sys.platform.startswith("linux") else ["jpeg"],
        include_dirs=[os.path.join(prefix, "include")] if prefix else [],
        library_dirs=[os.path.join(prefix, "lib")] if prefix else [],
        extra_compile_args=["-O2", "-ffp-contract=off"], optional=True))

setup(ext_modules=extensions, cmdclass={"build_ext": OptionalBuildExt})
