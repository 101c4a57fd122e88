"""Runs inside the sandbox (standard library only): a program, then its tests one by one.

stdin: one JSON object, {"program": source, "tests": [statement, ...], "nonce": str}. Each
test's outcome is a line on stdout, `<nonce> <index> pass` or `<nonce> <index> fail <why>`,
flushed as it is known, so a program that hangs in its third test still has its first two
counted when the sandbox is killed. The nonce keeps the program's own prints from passing
for results; a program that reads this interpreter's frames can still find it: the sandbox
protects the machine, and a reward for such a program is the task author's to guard against.
"""

import json
import sys


def main() -> None:
    job = json.loads(sys.stdin.read())
    nonce, tests = job["nonce"], job["tests"]
    out = sys.stdout
    namespace = {"__name__": "__sandbox__"}
    try:
        exec(compile(job["program"], "<program>", "exec"), namespace)  # noqa: S102
    except BaseException as e:  # noqa: BLE001 - a program may raise anything, SystemExit too
        why = f"the program raised {type(e).__name__}: {e}"[:200].replace("\n", " ")
        for index in range(len(tests)):
            out.write(f"{nonce} {index} fail {why}\n")
        out.flush()
        return
    for index, test in enumerate(tests):
        try:
            exec(compile(test, f"<test {index}>", "exec"), namespace)  # noqa: S102
            out.write(f"{nonce} {index} pass\n")
        except BaseException as e:  # noqa: BLE001
            why = f"{type(e).__name__}: {e}"[:200].replace("\n", " ")
            out.write(f"{nonce} {index} fail {why}\n")
        out.flush()


if __name__ == "__main__":
    main()
