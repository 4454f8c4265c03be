"""A resume with a larger `run.steps` and `optim.decay_steps` unset stretches the schedule under
the run (README's Quick start says so): the learning rate jumped at the resume without a word
(0.00033 at step 20 became 0.0026 at step 25 in a 20 -> 80 resume)."""

from trainer.config import load_config
from trainer.train import schedule_change


def saved_meta(steps: int, decay_steps: int | None = None) -> dict:
    saved = load_config(None, [f"run.steps={steps}"]).to_dict()
    saved["optim"]["decay_steps"] = decay_steps
    return {"config": saved}


def test_a_longer_run_without_decay_steps_says_the_learning_rate_moves():
    config = load_config(None, ["run.steps=80", "optim.warmup_steps=2"])
    line = schedule_change(config, saved_meta(20), step=20)
    assert line is not None and line.startswith(
        "warning: run.steps 20 -> 80 with optim.decay_steps unset stretches the cosine schedule "
        "over 80 steps: the learning rate at step 20 is 0.000"
    )
    assert line.endswith("; set optim.decay_steps=20 to keep that schedule")


def test_a_resume_that_keeps_its_schedule_says_nothing():
    longer = load_config(None, ["run.steps=80"])
    assert schedule_change(longer, saved_meta(20, decay_steps=20), step=20) is None  # saved one
    pinned = load_config(None, ["run.steps=80", "optim.decay_steps=20"])
    assert schedule_change(pinned, saved_meta(20), step=20) is None
    same = load_config(None, ["run.steps=20"])
    assert schedule_change(same, saved_meta(20), step=10) is None
    constant = load_config(
        None, ["run.steps=80", "optim.schedule=constant", "optim.warmup_steps=2"]
    )
    assert schedule_change(constant, saved_meta(20), step=20) is None  # the rate is the same
    assert schedule_change(longer, {}, step=20) is None  # a checkpoint without its config
