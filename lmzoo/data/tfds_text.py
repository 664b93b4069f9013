"""Turn local text into a prepared TFDS dataset (array_record; readable without TensorFlow).

prepare_text_dataset("/data/tfds", {"train": docs, "validation": docs})
# then: config.data.source="tfds", config.data.name="lmzoo_text", config.data.data_dir="/data/tfds"
"""

import tensorflow_datasets as tfds


class LmzooText(tfds.core.GeneratorBasedBuilder):
    """Documents with one "text" feature; the splits are given at construction."""

    VERSION = tfds.core.Version("1.0.0")

    def __init__(self, *, splits: dict[str, list[str]] | None = None, **kwargs):
        self._splits = splits or {}
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
        return {name: self._generate_examples(docs) for name, docs in self._splits.items()}

    def _generate_examples(self, docs):
        for i, doc in enumerate(docs):
            yield i, {"text": doc}


def prepare_text_dataset(data_dir: str, splits: dict[str, list[str]]) -> str:
    """Writes the dataset under data_dir and returns its TFDS name ("lmzoo_text")."""
    empty = [name for name, docs in splits.items() if not docs]
    if empty:
        raise ValueError(f"splits {empty} have no documents")
    LmzooText(splits=splits, data_dir=data_dir, file_format="array_record").download_and_prepare()
    return LmzooText.name
