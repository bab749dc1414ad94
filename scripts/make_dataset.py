"""Write the procedurally generated demo dataset (JPEG, ImageFolder layout) to a local path.

python scripts/make_dataset.py --root outputs/remote/data/mine --num-classes 10 --train-per-class 500
python scripts/make_dataset.py --root /tmp/shapes --test-per-class 100   # also a held-out test/ split

It writes only where nothing would be lost: a new or empty folder, or demo data it made before
(DATASET.json). A folder holding anything else (your own images) is refused in one line, exit 2,
by the rule the job applies to paths.data_dir; --force replaces its train/, val/ and test/.
"""

import argparse
import sys

from goodput.data.synthetic import COMPLETE, foreign_files, make_dataset


def main(argv=None) -> int:
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
    p.add_argument(
        "--force", action="store_true",
        help="write into a folder that holds other files: its train/, val/ and test/ are replaced",
    )  # fmt: skip
    a = p.parse_args(argv)
    foreign = foreign_files(a.root)
    if foreign and not a.force:  # somebody's files: never deleted without being asked
        shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        print(
            f"make_dataset.py: {a.root} holds {shown} but no {COMPLETE}: it is not demo data this script "
            f"made, so nothing is written there. Name a new or empty folder, or pass --force to replace "
            f"its train/, val/ and test/",
            file=sys.stderr,
        )
        return 2
    try:
        n = make_dataset(
            a.root, a.num_classes, a.train_per_class, a.val_per_class, a.image_size, a.seed,
            test_per_class=a.test_per_class,
        )  # fmt: skip
    except ValueError as e:
        p.error(str(e))
    test = f" / {n['test']} test" if "test" in n else ""
    print(f"wrote {n['train']} train / {n['val']} val{test} images to {n['root']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
