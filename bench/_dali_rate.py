"""DALI's CPU pipeline over a folder of JPEGs on one core: the peer of KSpeed's region decode.

Run by ``bench/server_prep_cost.py --dali-python PY`` with a Python that has ``nvidia-dali`` (it
imports nothing of KSpeed's, nor torch). The pipeline is DALI's ImageNet training recipe on the CPU
(``device_id=None``): ``readers.file`` (shuffled), ``decoders.image_random_crop`` (libjpeg-turbo
decoding only the crop's region, area 8-100 %, aspect 3/4-4/3), ``resize`` to 224x224
(antialiased), a random horizontal ``flip``, ``transpose`` to CHW, ``num_threads=1``, the process
pinned to ``--core``. Prints one JSON line: samples/s over the timed epochs (after one warm-up) and
the process's CPU seconds per sample (every DALI thread included).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="an ImageFolder tree of JPEGs")
    parser.add_argument("--core", type=int, required=True)
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs, after one warm-up")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.core})

    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=args.batch, num_threads=1, device_id=None, seed=0)
    def training():
        jpegs, labels = fn.readers.file(file_root=args.root, random_shuffle=True, name="files")
        images = fn.decoders.image_random_crop(
            jpegs, device="cpu", output_type=types.RGB, random_area=[0.08, 1.0], random_aspect_ratio=[0.75, 4 / 3]
        )
        images = fn.resize(images, resize_x=224, resize_y=224)
        images = fn.flip(images, horizontal=fn.random.coin_flip())
        return fn.transpose(images, perm=[2, 0, 1]), labels

    pipe = training()
    pipe.build()
    size = pipe.epoch_size("files")
    steps = -(-size // args.batch)

    def epoch() -> int:
        samples = 0
        for _ in range(steps):
            images, _ = pipe.run()
            samples += len(images)
        return samples

    epoch()  # warm-up
    began, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    samples = sum(epoch() for _ in range(args.epochs))
    wall, cpu1 = time.perf_counter() - began, resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    print(json.dumps({"samples": samples, "samples_per_s": samples / wall, "cpu_s_per_sample": cpu / samples}))


if __name__ == "__main__":
    main()
