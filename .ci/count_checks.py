"""Count the package's hand-written argument checks.

A check block is an ``if`` statement (no ``elif``/``else``) whose body only
builds a message (assignments) and ends in ``raise``, or whose body is one call
to ``_checks.fail_type`` / ``_checks.fail_value``.  Its lines run from the
``if`` to the end of the body.  Calls to the one-line ``check_*`` helpers are
counted apart (one line each at the call site).

Usage: python .ci/count_checks.py [package_dir]
"""

from __future__ import annotations

import ast
import pathlib
import sys


def _is_raise_block(node: ast.If) -> bool:
    if node.orelse:
        return False
    *head, last = node.body
    if not isinstance(last, ast.Raise):
        return False
    return all(isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)) for s in head)


def _is_fail_call(node: ast.If) -> bool:
    if node.orelse or len(node.body) != 1:
        return False
    stmt = node.body[0]
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
            if isinstance(node, ast.If) and node.end_lineno is not None:
                span = node.end_lineno - node.lineno + 1
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
            print(f"{r[1] + r[3]:5d} lines  {r[0]:3d} raise  {r[2]:3d} fail_  {name}")
    print(
        f"raise blocks: {total[0]} / {total[1]} lines; "
        f"fail_ one-liners: {total[2]} / {total[3]} lines; "
        f"check lines: {total[1] + total[3]}; check_* calls: {total[4]}"
    )


if __name__ == "__main__":
    main()
