"""What a GPU run needs that the GPU machine cannot reach, in one ignored folder passed in the device tool's ``carry``
(64 MiB at most; ``../shared`` does not travel, and the machine reaches no Hub or package registry).

``--bundle finetune`` (issue 75, bench/gpu_finetune.sh): all-MiniLM-L6-v2 with its weights stored in float16 (about
45 MB; loaded back as float32, the rounding to float16 being the only change to the checkpoint) and its tokenizer,
``mnli/dev.jsonl`` and ``rte/{train,dev}.csv``. ``--bundle horizon`` (issue 76, bench/gpu_horizon.sh): the project's
CIFAR-10 images as one uint8 array file (`cifar10_uint8.npz`: ``x_train`` [N, 3, 32, 32] and ``y_train`` as
`bench/cifar10.load_folder` decodes them, ``x_test``, ``y_test``), which bench/horizon.py reads with ``--images``,
and ``wikitext-2/{valid,test}.txt`` for bench/language_model.py (57 MiB in all).

    python bench/gpu_bundle.py --bundle finetune      # writes gpu_data/ (ignored by git)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402  (the offline environment and the import path)
import torch  # noqa: E402

DEFAULT_FOLDER = os.path.join(harness.ROOT, "gpu_data")
CARRY_LIMIT = 64 * 2**20
NLI_FILES = (("mnli", "dev.jsonl"), ("rte", "train.csv"), ("rte", "dev.csv"))
TEXT_FILES = (("wikitext-2", "valid.txt"), ("wikitext-2", "test.txt"))


def finetune_bundle(data_dir: str, folder: str, model_path: str | None) -> None:
    import pretrained
    from transformers import AutoModel, AutoTokenizer

    source = model_path or pretrained.minilm_path()
    model = AutoModel.from_pretrained(source)  # the encoder alone: each task's run adds its own head
    model.to(torch.float16).save_pretrained(os.path.join(folder, "minilm"))
    AutoTokenizer.from_pretrained(source).save_pretrained(os.path.join(folder, "minilm"))
    copy_files(data_dir, folder, NLI_FILES)


def copy_files(data_dir: str, folder: str, files: tuple[tuple[str, str], ...]) -> None:
    for parts in files:
        os.makedirs(os.path.join(folder, parts[0]), exist_ok=True)
        shutil.copyfile(harness.data_file(data_dir, *parts), os.path.join(folder, *parts))


def horizon_bundle(data_dir: str, folder: str, limit: int | None) -> None:
    import cifar10

    root = harness.data_file(data_dir, "cifar10")
    per_split = None if limit is None else limit * len(cifar10.CLASSES)  # `load_folder` caps a split's total
    (x_train, y_train), (x_test, y_test) = (cifar10.load_folder(os.path.join(root, split), per_split)
                                            for split in ("train", "test"))
    np.savez_compressed(os.path.join(folder, "cifar10_uint8.npz"), x_train=x_train.numpy(), y_train=y_train.numpy(),
                        x_test=x_test.numpy(), y_test=y_test.numpy())
    copy_files(data_dir, folder, TEXT_FILES)


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", choices=("finetune", "horizon"), required=True)
    parser.add_argument("--data_dir", default=harness.DEFAULT_DATA)
    parser.add_argument("--folder", default=DEFAULT_FOLDER)
    parser.add_argument("--model_path", default=None, help="another local BERT (the smoke test's tiny one)")
    parser.add_argument("--limit", type=int, default=None, help="horizon: images per class and split (checks)")
    args = parser.parse_args()
    os.makedirs(args.folder, exist_ok=True)
    if args.bundle == "finetune":
        finetune_bundle(args.data_dir, args.folder, args.model_path)
    else:
        horizon_bundle(args.data_dir, args.folder, args.limit)
    size = folder_bytes(args.folder)
    print(f"{args.folder}: {size / 2**20:.1f} MiB")
    if size > CARRY_LIMIT:
        sys.exit(f"{args.folder} holds {size / 2**20:.1f} MiB, above the 64 MiB a device run carries: one bundle per "
                 "run (another --folder)")


if __name__ == "__main__":
    main()
