from feeder import synthetic
synthetic.make_image_folder("/tmp/rv/train", classes=3, per_class=10, size_range=(64, 128))
synthetic.make_segmentation_set("/tmp/rv/seg", count=20, size_range=(48, 120))
synthetic.make_detection_set("/tmp/rv/det", count=20, size_range=(64, 128))
