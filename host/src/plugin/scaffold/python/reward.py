"""{{name}}: a reward (it scores finished trajectories into named components). This one
gives `format` (the completion answers in <answer>...</answer>) and `correct` (that answer
is the sample's `answer` from its metadata; 0 when the sample has none). Replace the
scoring with yours; the run config weighs the components.

Config (JSON): {"tag": "answer"} (optional): the tag the answer is written in."""

import json
from typing import List

from app import parse_config
from componentize_py_types import Err
from wit_world.exports import reward
from wit_world.imports import types


class Scorer(reward.Scorer):
    @classmethod
    def open(cls, config: str) -> "Scorer":
        tag = parse_config(config, {"tag": "answer"})["tag"]
        if not isinstance(tag, str) or not tag or any(c in tag for c in "</>"):
            raise Err('{{name}} config: `tag` must be a tag name such as "answer"')
        scorer = cls()
        scorer.open_tag, scorer.close_tag = f"<{tag}>", f"</{tag}>"
        return scorer

    def score(self, trajectory: types.Trajectory) -> List[types.Component]:
        text = trajectory.completion
        given = None
        end = text.rfind(self.close_tag)
        if end != -1:
            start = text.rfind(self.open_tag, 0, end)
            if start != -1:
                given = text[start + len(self.open_tag) : end].strip()
        try:
            metadata = json.loads(trajectory.metadata)
        except ValueError as e:
            raise Err(f"{{name}}: the sample's metadata is not JSON: {e}")
        expected = metadata.get("answer") if isinstance(metadata, dict) else None
        if expected is not None and not isinstance(expected, str):
            expected = json.dumps(expected)
        correct = given is not None and given == (expected.strip() if expected else None)
        return [
            types.Component(name="format", value=1.0 if given is not None else 0.0),
            types.Component(name="correct", value=1.0 if correct else 0.0),
        ]
