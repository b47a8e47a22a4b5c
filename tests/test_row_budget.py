"""The server's row budget: its fit of step cost over rows, which drafted rows it keeps, and that cutting drafts leaves
every request's greedy output as it was (the sampled case is in test_spec_sampling.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from quasar_deploy.engine import Generation
from quasar_deploy.serve.row_budget import MIN_FORWARDS, RowBudget
from quasar_deploy.speculative.draft_length import DraftLength

from .serving import chat_engine, live_server

PROMPTS = [f"def f{i}(x):\n    return x + {i}\n\n\ndef f{i}(" for i in range(8)]


def test_the_fit_finds_what_one_more_row_costs_apart_from_what_a_sequence_costs():
    """Forwards of 1-8 sequences with 0-5 drafted rows each: 20 ms fixed, 8 ms a sequence, 3 ms a row. A fit on rows
    alone would charge the sequences' cost to the rows."""
    budget = RowBudget()
    for sequences, drafted in [(8, 40), (8, 8), (4, 20), (1, 5), (8, 24), (2, 2), (6, 30), (3, 0), (8, 16), (5, 10)]:
        rows = sequences + drafted
        budget.observe(rows, sequences, 0.02 + 0.008 * sequences + 0.003 * rows, tokens=sequences + drafted // 3)
    assert budget.seconds_per_row == pytest.approx(0.003)
    assert 0 < budget.threshold < 1


@pytest.mark.parametrize(
    "forwards",
    [[(6, 1)] * 20, [(12, 2)] * 20, [(6, 1), (12, 2)] * 10, [(6, 1), (2, 1)] * (MIN_FORWARDS // 2 - 1)],
    ids=["no-spread", "same-rows-per-sequence", "rows-follow-sequences", "too-few"],
)
def test_nothing_is_cut_until_the_fit_can_be_trusted(forwards):
    budget = RowBudget()
    for rows, sequences in forwards:
        budget.observe(rows, sequences, 0.01 * rows, tokens=2)
    assert budget.threshold == 0.0 and budget.keep(0.01, 5) == 5


def _budget_at(seconds_per_row: float, tokens_per_forward: int) -> RowBudget:
    """A budget that saw forwards of one sequence with 1-10 rows at ``seconds_per_row`` a row (and 10 ms a forward)."""
    budget = RowBudget()
    for rows in range(1, 11):
        budget.observe(rows, 1, 0.01 + seconds_per_row * rows, tokens=tokens_per_forward)
    return budget


def test_a_sequence_keeps_the_drafted_positions_worth_their_row():
    budget = _budget_at(0.01, 5)  # 10 ms a row; 5 tokens a forward of 65 ms on average
    threshold = budget.threshold
    assert threshold == pytest.approx(0.01 * 50 / 0.65, rel=0.15)
    assert budget.keep(0.99, 5) == 5  # 0.99 ** 5 is still worth it
    assert budget.keep(0.95, 5) == 1 + sum(0.95**j >= threshold for j in range(2, 6))
    assert budget.keep(0.5, 5) == 1 and budget.keep(0.0, 3) == 1  # the first is always computed: it measures the rate
    assert budget.keep(0.9, 0) == 0


def test_the_acceptance_rate_follows_the_kept_positions():
    length = DraftLength(5, adaptive=False)
    assert length.rate == 1.0
    for _ in range(30):
        length.observe(5, 1)  # one kept, the second rejected: half the judged positions
    assert length.rate == pytest.approx(0.5, abs=0.01)
    for _ in range(30):
        length.observe(5, 5)  # all kept
    assert length.rate == pytest.approx(1.0, abs=0.01)


def test_cut_drafts_leave_every_concurrent_requests_output_as_it_was(tiny_qwen3, monkeypatch):
    """Eight clients on a server whose budget cuts most drafts: each gets its solo greedy output, and drafts were cut."""
    import openai

    pytest.importorskip("fastapi")
    from quasar_deploy.serve.app import ServeConfig, create_app

    engine = chat_engine(tiny_qwen3)
    alone = [engine.generate(p, max_new_tokens=24).text for p in PROMPTS]
    monkeypatch.setattr(RowBudget, "threshold", property(lambda self: 0.6))
    cuts = []
    trim = Generation.trim_draft
    monkeypatch.setattr(Generation, "trim_draft", lambda self, keep: cuts.append(keep) or trim(self, keep))
    with live_server(create_app(engine, ServeConfig("tiny"))) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0, timeout=60)

        def complete(i: int) -> str:
            return client.completions.create(model="tiny", prompt=PROMPTS[i], temperature=0, max_tokens=24).choices[0].text

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(complete, range(len(PROMPTS))))
    assert texts == alone
    assert cuts, "the budget cut no draft: the test did not test cutting"
