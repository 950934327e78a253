#!/usr/bin/env python3
"""Index an ImageFolder data set once, so that training processes read one small file instead of
listing every class folder (minutes for ImageNet's 1.28M files on a network filesystem, in every
process of every job). docs/data.md says where the index goes and when the scripts trust it.

    python tools/index_images.py DATA             # DATA/train and DATA/val
    python tools/index_images.py DATA/train ...   # the folders named
"""

import argparse
import contextlib
import os
import socket
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import distributed  # noqa: E402  (the scripts' own listing and index names)


def write_index(path, samples):
    """Atomic: a temporary file of this host and process, synced, then renamed over `path`."""
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


def folder_times(folder):
    """The modification time of every folder the listing walks: `folder` and all below it."""
    return {
        os.path.relpath(d, folder): os.stat(d).st_mtime_ns
        for d, _, _ in os.walk(folder, followlinks=True)
    }


def index(folder, attempts=3):
    """Writes the index of `folder` where the scripts look first that can be written; returns
    (path, samples). An index that is current already is left as it is."""
    for _ in range(attempts):
        # the times are taken before the listing reads each folder, and again after: a change in
        # between moves one
        before = folder_times(folder)
        samples, found, _ = distributed.list_images(folder)
        if found:
            return found, samples
        if folder_times(folder) == before:
            break
    else:
        raise distributed.UserError(
            f"{folder} changed while it was listed, {attempts} times: no index written"
        )
    samples.update(
        folders=np.asarray(list(before), dtype=str),
        mtimes=np.asarray(list(before.values()), dtype=np.int64),
    )
    errors = []
    for path in distributed.index_paths(folder):
        try:
            write_index(path, samples)
            return path, samples
        except OSError as e:  # a read-only data folder: the user's cache
            errors.append(f"{path}: {e.strerror or e}")
    raise OSError("cannot write an index: " + "; ".join(errors))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folders", nargs="+", metavar="DATA", help="with train/ and val/, or a split")
    folders = []
    for folder in p.parse_args(argv).folders:
        splits = [os.path.join(folder, s) for s in ("train", "val")]
        folders += [s for s in splits if os.path.isdir(s)] or [folder]
    try:
        for folder in folders:
            if not os.path.isdir(folder):
                raise distributed.UserError(f"{folder} is not a folder")
            path, samples = index(folder)
            n, classes = len(samples["targets"]), len(samples["classes"])
            print(f"{folder}: {n} images in {classes} classes -> {path}")
    except (distributed.UserError, OSError) as e:
        print(f"index_images.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
