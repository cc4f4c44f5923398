"""One learner per store: a second `specd learner` or a second server with its own learner on the
same store is refused in one line naming the first one's pid (two publishing into one store, or
numbering records into one spool, lost records as duplicates)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from specd.core.errors import StoreError
from specd.drafter.factory import DrafterSpec
from specd.learner.claim import claim
from specd.serving.serve import ServeOptions, build_server
from specd.testing import ByteTokenizer, tiny_loaded_target


def test_a_second_claim_on_a_store_is_refused_until_the_first_is_released(tmp_path: Path) -> None:
    first = claim(tmp_path, "stop it")
    with pytest.raises(StoreError, match=f"pid {os.getpid()}.*one learner per store; stop it"):
        claim(tmp_path, "stop it")
    first.release()
    claim(tmp_path, "stop it").release()


def test_a_second_server_with_a_learner_on_the_same_store_is_refused(tmp_path: Path) -> None:
    loaded = replace(tiny_loaded_target(), tokenizer=ByteTokenizer())
    options = ServeOptions(store=str(tmp_path / "store"), model_name="tiny", drafter=DrafterSpec(head_vocab=200),
                           learner_mode="thread")
    first = build_server(options, loaded)
    with pytest.raises(StoreError, match="--no-learner"):
        build_server(options, loaded)
    build_server(replace(options, learner=False), loaded)  # serving the store's live version alone is fine
    assert first is not None
