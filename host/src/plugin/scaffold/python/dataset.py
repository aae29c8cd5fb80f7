"""{{name}}: a dataset (a source of task samples). This one makes addition problems whose
answer is in the sample's metadata. Replace the problems with yours; keep each sample a
function of the seed and the index alone, so that runs repeat and resume exactly.

Config (JSON): {"size": 1000} (optional): how many samples there are."""

import json
import random

from app import parse_config
from componentize_py_types import Err
from wit_world.exports import dataset
from wit_world.imports import types


class Source(dataset.Source):
    @classmethod
    def open(cls, config: str, seed: int) -> "Source":
        parsed = parse_config(config, {"size": 1000})
        size = parsed["size"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise Err("{{name}} config: `size` must be an integer of at least 1")
        source = cls()
        source.size = size
        source.seed = seed
        return source

    def len(self) -> int:
        return self.size

    def get(self, index: int) -> types.Sample:
        if index >= self.size:
            raise Err(f"index {index} is past the {self.size} samples")
        # A generator of its own per sample: the sample depends on (seed, index) alone.
        r = random.Random(self.seed * 1_000_003 + index)
        a, b = r.randrange(1000), r.randrange(1000)
        prompt = f"What is {a} + {b}? Answer as <answer>N</answer>."
        return types.Sample(
            messages=[types.Message(role="user", content=prompt, tool_calls=[], tool_call_id=None)],
            metadata=json.dumps({"answer": a + b}),
        )
