"""README's "Use" snippet runs as pasted on the CPU (so the docs cannot rot), and what it shows
holds: ``model.generate`` on the left-padded batch continues the short prompt as it would alone,
and the streamed request is aborted with nothing produced after."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
START = "import torch_cp\nfrom torch_cp.tiny import tiny_qwen3, tiny_tokenizer\n"


def test_the_use_snippet_runs_as_pasted(capsys):
    text = README.read_text()
    begin = text.index(START)
    snippet = text[begin:text.index("```", begin)]
    scope: dict = {}
    exec(compile(snippet, str(README), "exec"), scope)  # noqa: S102  (our own README)
    model, tokenizer, ids = scope["model"], scope["tokenizer"], scope["ids"]
    alone = model.generate(**tokenizer(["Hi"], return_tensors="pt"), max_new_tokens=8)
    assert ids[0, -8:].tolist() == alone[0, -8:].tolist()
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1].endswith("abort"), printed[-3:]
