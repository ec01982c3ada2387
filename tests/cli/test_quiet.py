"""The CLI's quiet output: known noise dropped (also for a plain Trainer, by one call), our warnings without a place."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

import lightning_mlopt
from lightning_mlopt.cli import quiet, quiet_lightning

LOGGERS = [logging.getLogger(f"lightning.{part}.utilities.rank_zero") for part in ("pytorch", "fabric")]
TIP = "💡 Tip: For seamless cloud logging"  # Lightning's, at every Trainer made without its paid logger
LEAF_SPEC = "`isinstance(treespec, LeafSpec)` is deprecated"  # torch's, at each of Lightning's batch flattenings


@pytest.fixture(autouse=True)
def _as_before() -> Iterator[None]:
    """Filters and the warning format as a fresh process has them (an in-process CLI run may have installed them)."""
    filters = [list(logger.filters) for logger in LOGGERS]
    shown = warnings.formatwarning
    for logger in LOGGERS:
        for each in [f for f in logger.filters if isinstance(f, quiet._DropLines)]:
            logger.removeFilter(each)
    try:
        with warnings.catch_warnings():  # filterwarnings entries go with it
            yield
    finally:
        warnings.formatwarning = shown
        for logger, kept in zip(LOGGERS, filters, strict=True):
            logger.filters[:] = kept


def _plain_fit(root: Path, quieted: bool) -> list[str]:
    """A script's own Trainer, fitted for two steps (after ``quiet_lightning()`` if ``quieted``): its warnings."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        if quieted:
            quiet_lightning()  # its filters go first, as they do at the top of a script
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=2, enable_progress_bar=False, enable_model_summary=False,
            limit_val_batches=0, enable_checkpointing=False, default_root_dir=root,
        )  # fmt: skip
        trainer.fit(BoringModel())
    return [str(w.message) for w in raised]


@pytest.mark.parametrize("quieted", [False, True], ids=["as Lightning says it", "quiet_lightning()"])
def test_quiet_lightning_drops_the_clis_known_noise_from_a_plain_trainer(tmp_path, caplog, quieted):
    with caplog.at_level(logging.INFO):
        raised = _plain_fit(tmp_path, quieted)
    assert "GPU available:" in caplog.text, "every other line stays"
    assert (TIP in caplog.text) is not quieted
    assert any(LEAF_SPEC in message for message in raised) is not quieted


def test_quiet_lightning_is_public_and_documented() -> None:
    from tests.conftest import REPO

    assert "quiet_lightning" in lightning_mlopt.cli.__all__ and quiet_lightning.__doc__
    docs = (REPO / "docs" / "configuration.md").read_text()
    assert "from lightning_mlopt.cli import quiet_lightning" in docs and "quiet_lightning()" in docs


def test_the_cli_shows_our_warnings_without_the_line_of_ours_that_noticed() -> None:
    from lightning_mlopt.checkpoint.resume import say_what_is_not_exact
    from lightning_mlopt.cli.quiet import show_our_warnings_plainly

    show_our_warnings_plainly()
    show_our_warnings_plainly()  # idempotent: once wrapped, not twice
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        say_what_is_not_exact([object()], "Resuming")  # Lightning's rank_zero_warn, at a line of checkpoint/resume.py
        warnings.warn_explicit("someone else's", UserWarning, "/elsewhere/their_module.py", 7)
    # What Python's showwarning prints for each (pytest shows warnings its own way).
    ours, theirs = (warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line) for w in raised)
    assert raised[0].filename.endswith("resume.py"), "recorded at our line; shown without it"
    assert ours.startswith("UserWarning: Resuming: not exact: the train object is not a DataLoader"), ours
    assert ours.count("\n") == 1, "no source line under it either"
    assert theirs.startswith("/elsewhere/their_module.py:7: UserWarning: someone else's")
