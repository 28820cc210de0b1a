"""Count the package's hand-written argument checks.

A check block is an ``if`` (or ``elif``) branch whose body only builds a
message (assignments) and ends in ``raise`` or in a call to a ``fail_*``
helper (``_checks.fail_type`` / ``fail_value`` and the like).  Its lines run
from the ``if`` to the end of that branch's body (an ``else`` is not counted).  Calls to the one-line ``check_*`` helpers are
counted apart (one line each at the call site).

Usage: python .ci/count_checks.py [package_dir]
"""

from __future__ import annotations

import ast
import pathlib
import sys


def _is_raise_block(node: ast.If) -> bool:
    *head, last = node.body
    if not isinstance(last, ast.Raise):
        return False
    return all(isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)) for s in head)


def _is_fail_call(node: ast.If) -> bool:
    *head, stmt = node.body
    if not all(isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)) for s in head):
        return False
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return False
    func = stmt.value.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name.startswith("fail_")


def _is_check_call(node: ast.AST) -> bool:
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        return False
    func = node.value.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name.startswith("check_")


def main() -> None:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "funcaccel")
    per_file: dict[str, list[int]] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        row = [0, 0, 0, 0, 0]
        for node in ast.walk(tree):
            if isinstance(node, ast.If):
                end = node.body[-1].end_lineno or node.lineno
                span = end - node.lineno + 1
                if _is_raise_block(node):
                    row[0] += 1
                    row[1] += span
                elif _is_fail_call(node):
                    row[2] += 1
                    row[3] += span
            elif _is_check_call(node):
                row[4] += 1
        per_file[str(path)] = row
    total = [sum(r[i] for r in per_file.values()) for i in range(5)]
    for name, r in sorted(per_file.items(), key=lambda kv: -(kv[1][1] + kv[1][3])):
        if r[1] + r[3]:
            print(f"{r[1] + r[3]:5d} lines  {r[0]:3d} raise  {r[2]:3d} fail_*  {name}")
    print(
        f"raise blocks: {total[0]} / {total[1]} lines; "
        f"fail_* blocks: {total[2]} / {total[3]} lines; "
        f"check lines: {total[1] + total[3]}; check_* calls: {total[4]}"
    )


if __name__ == "__main__":
    main()
