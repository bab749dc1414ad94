"""Write the procedurally generated demo dataset (JPEG, ImageFolder layout) to a local path.

python scripts/make_dataset.py --root outputs/remote/data/mine --num-classes 10 --train-per-class 500
python scripts/make_dataset.py --root /tmp/shapes --test-per-class 100   # also a held-out test/ split
"""

import argparse

from goodput.data.synthetic import make_dataset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True, help="output folder (train/ and val/ are created in it)")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--train-per-class", type=int, default=500)
    p.add_argument("--val-per-class", type=int, default=100)
    p.add_argument(
        "--test-per-class", type=int, default=0,
        help="also write test/<class>/ (training never reads it; scripts/evaluate.py --split test does)",
    )  # fmt: skip
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    try:
        n = make_dataset(
            a.root, a.num_classes, a.train_per_class, a.val_per_class, a.image_size, a.seed,
            test_per_class=a.test_per_class,
        )  # fmt: skip
    except ValueError as e:
        p.error(str(e))
    test = f" / {n['test']} test" if "test" in n else ""
    print(f"wrote {n['train']} train / {n['val']} val{test} images to {n['root']}")


if __name__ == "__main__":
    main()
