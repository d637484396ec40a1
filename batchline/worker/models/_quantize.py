"""NNCF's int8 quantization of an OpenVINO-readable model, run as its own process.

``python -m batchline.worker.models._quantize SOURCE BATCHES TARGET`` reads the fp32 model
``SOURCE`` (ONNX), the calibration batches ``BATCHES`` (a JSON list of batches, each a map
of input name to token ids, rows padded to one length, written by
:func:`batchline.worker.models._backends.ensure_int8_static`),
and writes the quantized model (IR) to ``TARGET`` (``.xml`` and ``.bin``). A worker runs it
in a child process: NNCF, all it imports (scipy, scikit-learn, networkx) and the memory
quantizing takes (a copy of the model and its statistics) are given back when the child
exits, so the serving process holds only the compiled model.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

import numpy as np


def read_batches(path: str) -> list[dict[str, np.ndarray]]:
    """The calibration batches of a JSON file, as int64 arrays."""
    with open(path, encoding="utf-8") as file:
        batches = json.load(file)
    return [{name: np.asarray(ids, dtype=np.int64) for name, ids in b.items()} for b in batches]


def quantize(source: str, batches: list[dict[str, np.ndarray]], target: str) -> None:
    import nncf
    import openvino

    model: Any = openvino.Core().read_model(source)
    with contextlib.redirect_stdout(sys.stderr):  # NNCF's progress bars
        quantized = nncf.quantize(
            model,
            nncf.Dataset(batches),
            model_type=nncf.ModelType.TRANSFORMER,
            subset_size=len(batches),
        )
    openvino.save_model(quantized, target, compress_to_fp16=False)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(
            "usage: python -m batchline.worker.models._quantize SOURCE BATCHES TARGET",
            file=sys.stderr,
        )
        return 2
    source, batches, target = argv
    quantize(source, read_batches(batches), target)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
