"""{{name}}: a trigger (a tool the model calls in the middle of generation). This one
upper-cases what the model writes between <shout> and </shout> and returns it as
<result>...</result>. Replace the tool with yours.

Config (JSON): {"suffix": "!"} (optional) is appended to each result."""

from typing import List, Optional

from app import parse_config
from componentize_py_types import Err
from wit_world.exports import trigger
from wit_world.imports import types

OPEN = "<shout>"
CLOSE = "</shout>"


class Session(trigger.Session):
    """One trajectory's session: it may keep state between the calls of that trajectory."""

    @classmethod
    def open(cls, config: str, sample: types.Sample) -> "Session":
        parsed = parse_config(config, {"suffix": ""})
        if not isinstance(parsed["suffix"], str):
            raise Err("{{name}} config: `suffix` must be a string")
        session = cls()
        session.suffix = parsed["suffix"]
        return session

    def stop_patterns(self) -> List[str]:
        return [CLOSE]

    def fire(self, text: str) -> Optional[str]:
        # The host fires when the text ends with a stop pattern; check anyway.
        if not text.endswith(CLOSE):
            return None
        body = text[: -len(CLOSE)]
        start = body.rfind(OPEN)
        if start == -1:
            return None
        return f"<result>{body[start + len(OPEN):].upper()}{self.suffix}</result>"
