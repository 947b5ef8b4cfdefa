"""ops.Albumentations with mask + boxes: do they stay consistent with the image?"""
import sys; sys.argv = ["x", "none"]
import albumentations as A
exec(open("repro/p4_geom.py").read().split("tests = {")[0])
from feeder import ops
bp = A.BboxParams(format="pascal_voc")
check("alb crop+flip", [ops.Albumentations(A.Compose([A.RandomCrop(64, 64), A.HorizontalFlip()], bbox_params=bp), output_size=64)])
check("alb shift-scale-rotate", [ops.Resize((64, 64)), ops.Albumentations(A.Compose([A.Affine(rotate=(-30, 30), p=1)], bbox_params=bp), output_size=64)], tol=3)
check("alb no bbox_params", [ops.Albumentations(A.Compose([A.RandomCrop(64, 64), A.HorizontalFlip()]), output_size=64)])
check("alb coco-format params", [ops.Albumentations(A.Compose([A.RandomCrop(64, 64)], bbox_params=A.BboxParams(format="coco")), output_size=64)])
