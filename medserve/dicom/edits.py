"""Edited copies of a header, for handing to highdicom what it can take while the caller's stays as it was."""

from __future__ import annotations

from pydicom.datadict import keyword_for_tag
from pydicom.dataset import Dataset


def copy_with(dataset: Dataset, changes: dict[str, object]) -> Dataset:
    """A new dataset holding `dataset`'s elements but with `changes` (keyword: value; None for an empty one), and
    its file meta, file name and original encoding. The other elements are decoded with the source's own character
    set, whatever `changes` makes it, and are shared with `dataset`, not copied: change an element through
    `changes` only. (`copy.copy` of a Dataset shares its element table: a change would reach the caller's.)"""
    edited = Dataset()
    for tag in dataset.keys():
        if keyword_for_tag(tag) not in changes:  # a replaced one may not even decode ('abc' as a DS)
            edited.add(dataset[tag])
    if (file_meta := getattr(dataset, "file_meta", None)) is not None:  # datasets built in memory may have none
        edited.file_meta = file_meta
    if (filename := getattr(dataset, "filename", None)) is not None:
        edited.filename = filename
    implicit_vr, little_endian = dataset.original_encoding
    edited.set_original_encoding(implicit_vr, little_endian, dataset.original_character_set)
    for keyword, value in changes.items():
        setattr(edited, keyword, value)
    return edited
