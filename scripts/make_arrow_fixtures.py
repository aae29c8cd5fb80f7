#!/usr/bin/env python3
"""Writes the Arrow IPC files the dataset reader is tested on (tests/fixtures/data/), with
the libraries users have them from, so the reader meets real files, not its own writer's:

- `mbpp_saved/`: `datasets.Dataset.save_to_disk` of MBPP-shaped rows in two shards
  (`data-0000N-of-00002.arrow`, Arrow IPC streams, and `state.json`), which is also the
  format of `datasets`' cache files;
- `chat.feather`: `pyarrow.feather.write_feather` (Feather v2 = the Arrow IPC file format,
  lz4-compressed by default) of rows with `messages` as list<struct<role, content>>, a
  nullable `answer` and an int64 `level`;
- `chat_zstd.arrow`: the same rows through `pyarrow.ipc.new_file` with zstd compression;
- `prompts.arrows`: an uncompressed Arrow IPC stream of `prompt`/`answer` rows with a
  null `prompt` in row 2 (a bad row).

    python3 -m venv /tmp/arrowvenv && /tmp/arrowvenv/bin/pip install datasets pyarrow
    /tmp/arrowvenv/bin/python scripts/make_arrow_fixtures.py

Made with datasets 5.2.0 and pyarrow 26.0.1.
"""

import json
import os
import shutil

import datasets
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.ipc as ipc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "data")


def main():
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(ROOT, "configs", "data", "mbpp-sample.jsonl")) as f:
        mbpp = [json.loads(line) for line in f][:6]
    saved = os.path.join(OUT, "mbpp_saved")
    shutil.rmtree(saved, ignore_errors=True)
    datasets.Dataset.from_list(mbpp).save_to_disk(saved, num_shards=2)

    chats = pa.table({
        "messages": [
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
            [{"role": "user", "content": "3*3?"}],
            [{"role": "user", "content": "Name a prime."}],
        ],
        "answer": ["4", "9", None],
        "level": pa.array([1, 2, 3], pa.int64()),
    })
    feather.write_feather(chats, os.path.join(OUT, "chat.feather"))
    with ipc.new_file(os.path.join(OUT, "chat_zstd.arrow"), chats.schema,
                      options=ipc.IpcWriteOptions(compression="zstd")) as w:
        w.write_table(chats)

    prompts = pa.table({"prompt": ["one", "two", None, "four"], "answer": ["1", "2", "3", "4"]})
    with ipc.new_stream(os.path.join(OUT, "prompts.arrows"), prompts.schema) as w:
        for batch in prompts.to_batches(max_chunksize=2):
            w.write_batch(batch)
    for name in sorted(os.listdir(OUT)):
        print(os.path.join(OUT, name))


if __name__ == "__main__":
    main()
