#!/usr/bin/env python3
"""Index an ImageFolder data set once, so that training processes read one small file instead of
listing every class folder (minutes for ImageNet's 1.28M files on a network filesystem, in every
process of every job).

    python tools/index_images.py DATA             # DATA/train and DATA/val
    python tools/index_images.py DATA/train ...   # the folders named

The index goes beside the data (DATA/.image-lists/), or into the user's cache
(~/.cache/pytorch-distributed, or $XDG_CACHE_HOME/pytorch-distributed) where the data is read-only:
the two places the training scripts look. It holds the packed sample list the scripts build
(distributed.py's pack_samples). Its name holds a key of the folder's real path and its class
folders' names and modification times: once images are added, removed or renamed, the scripts no
longer read it and list the folder themselves, until this tool is run again.

Several jobs may run it on the same data at once: each writes a temporary file of its own and
renames it into place, so a reader sees a whole index or none, and the last rename wins.
"""
import argparse
import contextlib
import glob
import os
import socket
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import distributed  # noqa: E402  (the scripts' own listing and index names)


def write_index(path, samples):
    """Atomic: a temporary file named after this host and process, synced, then renamed over `path`."""
    tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **samples)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def index(folder):
    """Writes the index of `folder` where the scripts look first that can be written; returns
    (path, samples). An index that is current already is left as it is."""
    samples, found = distributed.list_images(folder)
    classes = [str(c) for c in samples["classes"]]
    paths = distributed.index_paths(folder, classes)
    if found:
        return next(p for p in paths if os.path.dirname(p) == found), samples
    errors = []
    for path in paths:
        try:
            write_index(path, samples)
        except OSError as e:  # a read-only data folder: the user's cache
            errors.append(f"{path}: {e.strerror or e}")
            continue
        if path == paths[0]:  # beside the data: earlier indexes of this folder are stale now
            prefix = os.path.basename(path).rsplit("-", 1)[0]
            for old in glob.glob(os.path.join(os.path.dirname(path), prefix + "-*.npz")):
                if old != path:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(old)
        return path, samples
    raise OSError("cannot write an index: " + "; ".join(errors))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folders", nargs="+", metavar="DATA",
                   help="a data folder with train/ and val/, or ImageFolder trees of class folders")
    args = p.parse_args(argv)
    folders = []
    for folder in args.folders:
        splits = [os.path.join(folder, s) for s in ("train", "val") if os.path.isdir(os.path.join(folder, s))]
        folders += splits or [folder]
    try:
        for folder in folders:
            if not os.path.isdir(folder):
                raise distributed.UserError(f"{folder} is not a folder")
            path, samples = index(folder)
            print(f"{folder}: {len(samples['targets'])} images in {len(samples['classes'])} classes -> {path}")
    except (distributed.UserError, OSError) as e:
        print(f"index_images.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
