"""lm-eval's command line with lmzoo's runs as the model "lmzoo".

    python -m lmzoo.cli.harness run --model lmzoo --model_args workdir=runs/gpt2 \\
        --tasks my_task --include_path tasks/ [--num_fewshot 4] [--limit 100]

lm-eval 0.4.13 finds third-party models only through `register_model` in the running process (it has no plugin
entry points), so the `lm_eval` script itself cannot see "lmzoo": this module registers it, then runs lm-eval's own
command line. From Python, importing this module is enough: `lm_eval.simple_evaluate(model="lmzoo",
model_args="workdir=...")`, or pass `lmzoo.evaluation.harness.LmzooLM(lmzoo.load(...))`. model_args: workdir,
step, batch_size, max_gen_toks (default 256).
"""

import sys

import lm_eval.models  # noqa: F401  (lm-eval's own models, registered before this one so `--model hf` still works)
from lm_eval.api.registry import register_model

from lmzoo.evaluation import harness
from lmzoo.train import run as run_lib


@register_model("lmzoo")
class WorkdirLM(harness.LmzooLM):
    """`harness.LmzooLM` over a train.py run's latest (or `step`'s) checkpoint, as lm-eval's `--model_args` name it."""

    def __init__(
        self,
        workdir: str | None = None,
        step: int | None = None,
        batch_size: int | str | None = 16,
        max_gen_toks: int = 256,
        **unused,
    ):
        if workdir is None:
            raise ValueError("the lmzoo model needs --model_args workdir=PATH (a train.py run)")
        loaded = run_lib.load(workdir, None if step is None else int(step))
        super().__init__(loaded, batch_size=batch_size, max_gen_toks=max_gen_toks)


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "lm_eval"
    cli_evaluate()


if __name__ == "__main__":
    main()
