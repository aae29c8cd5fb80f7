"""The multiply task's calculator for the Tinker scripts (client.py, cookbook.py), as the
multiply plugin's trigger answers a call: the last `<calc>` expression of a turn that ends
with `</calc>` evaluated, or an error. A calculator that answered a*b whatever the call said
would leave the expression unrewarded: it drifts into noise, and in time the noise breaks
the answer format for good."""

import ast
import operator

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expr):
    """The value of an arithmetic expression (numbers, + - * /, parentheses); ValueError
    for anything else (nothing is executed)."""

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        raise ValueError("not arithmetic")

    return value(ast.parse(expr.strip(), mode="eval").body)


def calc(text):
    """`<result>VALUE</result>` for a turn `text` that ends with `</calc>`."""
    body = text[: -len("</calc>")]
    start = body.rfind("<calc>")
    if start < 0:
        return "<result>error: </calc> without <calc></result>"
    try:
        v = evaluate(body[start + len("<calc>"):])
        shown = str(int(v)) if float(v).is_integer() else f"{v:.6f}".rstrip("0")
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError):
        shown = "error: not an arithmetic expression"
    return f"<result>{shown}</result>"
