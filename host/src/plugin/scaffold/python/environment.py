"""{{name}}: an environment (it answers each assistant turn). This one keeps the model
talking for a number of turns and rewards a last turn that says `done`. Replace the game
with yours.

Config (JSON): {"turns": 3} (optional): how many assistant turns an episode has."""


from app import parse_config
from componentize_py_types import Err
from wit_world.exports import environment
from wit_world.imports import types


class Episode(environment.Episode):
    """One trajectory's episode."""

    @classmethod
    def open(cls, config: str, sample: types.Sample) -> "Episode":
        parsed = parse_config(config, {"turns": 3})
        turns = parsed["turns"]
        if not isinstance(turns, int) or isinstance(turns, bool) or turns < 1:
            raise Err("{{name}} config: `turns` must be an integer of at least 1")
        episode = cls()
        episode.turns = turns
        episode.turn = 0
        return episode

    def step(self, assistant: str) -> types.StepResult:
        self.turn += 1
        if self.turn >= self.turns:
            said_done = "done" in assistant.lower()
            return types.StepResult(messages=[], done=True, reward=1.0 if said_done else 0.0)
        left = self.turns - self.turn
        message = types.Message(
            role="user",
            content=f"You wrote {len(assistant)} characters. {left} turns to go; say done in the last.",
            tool_calls=[],
            tool_call_id=None,
        )
        return types.StepResult(messages=[message], done=False, reward=None)
