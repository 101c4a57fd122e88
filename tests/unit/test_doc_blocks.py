"""How the docs runner reads a doc's marks (tests/support/doc_blocks.py)."""

from __future__ import annotations

import pytest

from tests.support.doc_blocks import fenced_blocks, with_train_sets

DOC = """# A page

```yaml file=my.yaml
rollout: {num_rollout: 4}
```

```bash runnable quick=rollout.num_rollout=2,eval.eval_interval=1
rollflow train --config my.yaml   # trains
rollflow runs list && rollflow train --config my.yaml
```

```bash
rollflow train --config not-run.yaml
```
"""


def test_blocks_carry_their_marks_and_lines(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text(DOC)
    saved, runnable, plain = fenced_blocks(doc)
    assert (saved.file_name, saved.runnable, saved.line) == ("my.yaml", False, 3)
    assert saved.text == "rollout: {num_rollout: 4}\n"
    assert runnable.runnable and runnable.quick_sets == ["rollout.num_rollout=2",
                                                         "eval.eval_interval=1"]
    assert runnable.where == "page.md:7"
    assert not plain.runnable and plain.language == "bash"


def test_sets_go_after_every_rollflow_train_and_nowhere_else():
    script = "rollflow train --config a.yaml  # a comment\nrollflow runs list && rollflow train -c b\n"
    got = with_train_sets(script, ["x.y=1"])
    assert got == ("rollflow train --set x.y=1 --config a.yaml  # a comment\n"
                   "rollflow runs list && rollflow train --set x.y=1 -c b\n")
    assert with_train_sets(script, []) == script


def test_an_unclosed_fence_names_its_line(tmp_path):
    doc = tmp_path / "broken.md"
    doc.write_text("text\n```bash runnable\nrollflow train\n")
    with pytest.raises(ValueError, match="broken.md:2"):
        fenced_blocks(doc)
