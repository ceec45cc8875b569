"""Images in a folder as a data SPEC (``--data DIR``), preprocessed by the model's own image processor.

Two layouts, as torchvision's ``ImageFolder`` and Hugging Face's ``imagefolder`` read them: one subfolder per
class (``DIR/cat/1.png``; the folder's name is a class id or a name in the config's ``id2label``), or the images
directly in ``DIR`` (unlabelled: a classifier's loss then takes its own top class, as for every unlabelled data).
How pixels are resized and scaled is the model's, not symgraph's to guess: it is read from the model folder's
``preprocessor_config.json`` (``AutoImageProcessor``); a model folder without one is refused with what to add.
"""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from .errors import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
PROCESSOR_FILE = "preprocessor_config.json"


def image_folder(root: Path, *, model_folder: Path | None, channels: int | None,
                 limit: int | None) -> tuple[torch.Tensor, list[str] | None]:
    """``(pixel_values, class names or None)`` of the images under ``root``, the first ``limit`` of them.

    Classes are interleaved (the first image of every class, then the second, ...; classes and files in name
    order), so every batch mixes the classes and a limit keeps some of each. Images are converted to grey for a
    one-channel model, to RGB otherwise, then handed to the model folder's image processor."""
    files, names = _layout(root)
    files, names = files[:limit], (names[:limit] if names is not None else None)
    processor = _processor(root, model_folder)
    mode = "L" if channels == 1 else "RGB"
    pixels = [_processed(processor, [_decoded(f, mode) for f in chunk], model_folder, chunk)
              for chunk in _chunks(files, 64)]
    return torch.cat(pixels), names


def _layout(root: Path) -> tuple[list[Path], list[str] | None]:
    top = _images_in(root)
    classes = [(d.name, _images_in(d)) for d in _subfolders(root)]
    classes = [(name, files) for name, files in classes if files]
    if top and classes:
        raise DataError(f"Image folder '{root}' holds images both directly and in class subfolders "
                        f"({', '.join(name for name, _ in classes[:3])}).",
                        hint="put every image in its class's subfolder, or all of them directly in the folder "
                             "(unlabelled).")
    if not top and not classes:
        raise DataError(f"Folder '{root}' holds no images ({', '.join(IMAGE_SUFFIXES)}), directly or one "
                        "subfolder down.", hint="pass a folder of images, one subfolder per class.")
    if top:
        return top, None
    pairs = [pair for rank in itertools.zip_longest(*[[(f, name) for f in files] for name, files in classes])
             for pair in rank if pair is not None]
    return [f for f, _ in pairs], [name for _, name in pairs]


def _images_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
                  and not p.name.startswith("."))


def _subfolders(folder: Path) -> list[Path]:
    return sorted(d for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))


def _processor(root: Path, model_folder: Path | None) -> Any:
    if model_folder is None or not (model_folder / PROCESSOR_FILE).is_file():
        where = f"the model folder '{model_folder}' has no {PROCESSOR_FILE}" if model_folder else \
            "no model folder was given"
        raise DataError(f"Cannot preprocess the images in '{root}': {where}, so how the model wants its pixels "
                        "resized and scaled is unknown.",
                        hint=f"save the model's image processor there (processor.save_pretrained(FOLDER) writes "
                             f"{PROCESSOR_FILE}), or give the pixels as pixel_values in a .npz file.")
    from transformers import AutoImageProcessor
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # "torchvision is not installed: using the PIL backend" is no news to the user
    try:
        return AutoImageProcessor.from_pretrained(str(model_folder), local_files_only=True)
    except Exception as exc:  # a damaged processor file is bad input, not a bug
        raise DataError(f"Cannot load the image processor in '{model_folder}': {type(exc).__name__}: "
                        f"{' '.join(str(exc).split())[:300]}",
                        hint=f"repair {PROCESSOR_FILE} there (processor.save_pretrained writes it).") from exc
    finally:
        logging.set_verbosity(verbosity)


def _decoded(file: Path, mode: str) -> Any:
    from PIL import Image

    try:
        with Image.open(file) as image:
            return image.convert(mode)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise DataError(f"Cannot read image '{file}': {exc}.",
                        hint="remove or replace the file; symgraph reads what Pillow reads.") from exc


def _processed(processor: Any, images: list, model_folder: Path | None, files: list[Path]) -> torch.Tensor:
    try:
        pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    except Exception as exc:  # a processor made for other images (say, RGB statistics for a grey model)
        raise DataError(f"The image processor in '{model_folder}' cannot preprocess '{files[0]}' and the images "
                        f"with it: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
                        hint="use the processor the model was trained with (its image_mean and image_std have "
                             "one entry per channel of the model).") from exc
    return torch.as_tensor(pixels, dtype=torch.float32)


def _chunks(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]
