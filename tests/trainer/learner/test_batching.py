"""Transitions -> micro-batches: packing under the token budget, token-space masks and logprobs, long prompts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.testing import assert_close

from lit_trainer.intake.episodes import Transition
from lit_trainer.learner.batching import (
    BatchingConfig,
    MicroBatch,
    PromptTooLong,
    budget_for,
    common_prefix,
    keep_usable,
    layout_tokens,
    make_micro_batches,
)

PAD = 0


def tr(prompt: list[int], response: list[int], logprobs: list[float] | None = None, index: int = 0) -> Transition:
    lp = logprobs if logprobs is not None else [-0.5] * len(response)
    return Transition(prompt, response, lp, None, "a", "r", "t", index, "s")


def test_rows_are_prompt_then_response_with_masks_and_logprobs_in_token_space():
    (mb,) = make_micro_batches([tr([5, 6, 7], [8, 9], [-0.1, -0.2]), tr([3], [4, 2, 1], [-1.0, -2.0, -3.0])],
                               [1.5, -0.5], BatchingConfig(), PAD)
    # Sorted by length: row 0 is the 4-token transition (index 1), row 1 the 5-token one (index 0).
    assert mb.index == [1, 0]
    assert_close(mb.input_ids, torch.tensor([[3, 4, 2, 1, PAD], [5, 6, 7, 8, 9]]))
    assert_close(mb.attention_mask, torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]))
    assert_close(mb.response_mask, torch.tensor([[0.0, 1, 1, 1, 0], [0, 0, 0, 1, 1]]))
    assert_close(mb.old_logprobs, torch.tensor([[0.0, -1.0, -2.0, -3.0, 0.0], [0, 0, 0, -0.1, -0.2]]))
    assert_close(mb.advantages, torch.tensor([-0.5, 1.5]))
    assert mb.n_response_tokens == 5


def test_token_budget_splits_micro_batches():
    # Lengths 4, 4, 6, 10, prompts sharing no first token (so each micro-batch is its groups padded), in prompt
    # order; budget 12: [4,4] (8 <= 12, adding 6 would make 3x6 = 18), [6] (6, adding 10 -> 20), [10].
    ts = [tr([1] * 2, [9] * 2), tr([4] * 8, [9] * 2), tr([2] * 3, [9] * 1), tr([3] * 5, [9] * 1)]
    batches = make_micro_batches(ts, [0.0] * 4, BatchingConfig(max_tokens_per_micro_batch=12), PAD)
    assert [mb.index for mb in batches] == [[0, 2], [3], [1]]
    assert all(mb.input_ids.numel() <= 12 for mb in batches)
    # One row longer than the budget still gets its own micro-batch rather than being lost.
    (alone,) = make_micro_batches([tr([1] * 20, [2])], [0.0], BatchingConfig(max_tokens_per_micro_batch=8), PAD)
    assert alone.input_ids.shape == (1, 21)


def test_long_prompts_are_rejected_or_cut_from_the_left_only_when_asked():
    long = tr(list(range(10, 20)), [7, 8])
    with pytest.raises(PromptTooLong, match="max_prompt_tokens=4.*truncate_prompt_left"):
        make_micro_batches([long], [1.0], BatchingConfig(max_prompt_tokens=4), PAD)
    (mb,) = make_micro_batches([long], [1.0], BatchingConfig(max_prompt_tokens=4, truncate_prompt_left=True), PAD)
    assert mb.input_ids.tolist() == [[16, 17, 18, 19, 7, 8]]
    assert mb.response_mask.tolist() == [[0, 0, 0, 0, 1, 1]]


def test_missing_behaviour_logprobs_and_bad_inputs_are_clear_errors():
    no_lp = Transition([1], [2], None, None, "a", "r", "t", 0, "s")
    with pytest.raises(ValueError, match="no behaviour logprobs"):
        make_micro_batches([no_lp], [1.0], BatchingConfig(), PAD)
    with pytest.raises(ValueError, match="empty prompt or response"):
        make_micro_batches([tr([], [2])], [1.0], BatchingConfig(), PAD)
    with pytest.raises(ValueError, match=r"batching.max_tokens_per_micro_batch must be 0 or >= 2 \(0: chosen for"):
        BatchingConfig(max_tokens_per_micro_batch=1)


def test_transitions_that_cannot_be_trained_on_are_skipped_and_counted_by_reason(caplog):
    good = [tr([1, 2], [3, 4], index=0), tr([5], [6], index=1)]
    bad = [tr([1] * 9, [2], index=2), tr([1] * 10, [2], index=3), tr([1], [2, 3], [-0.1], index=4),
           Transition([1], [2], None, None, "a", "r", "t", 5, "s"), tr([], [2], index=6), tr([1], [], index=7)]
    pairs = [(t, float(i + 1)) for i, t in enumerate(good + bad)]
    config = BatchingConfig(max_prompt_tokens=8)
    with caplog.at_level("WARNING", logger="lit"):
        kept, skipped = keep_usable(pairs, config)
    assert kept == pairs[:2]
    assert skipped == {"prompt_too_long": 2, "logprobs_length": 1, "no_logprobs": 1, "empty": 2}
    # One line per reason, with the first transition's words, however many were skipped.
    assert sorted(r.getMessage().split("(update/skipped_")[1].split(")")[0] for r in caplog.records) == [
        "empty", "logprobs_length", "no_logprobs", "prompt_too_long"]
    assert any("r#2 has a 9-token prompt, over batching.max_prompt_tokens=8" in r.getMessage()
               for r in caplog.records)
    (mb,) = make_micro_batches([t for t, _ in kept], [a for _, a in kept], config, PAD)  # the rest trains
    assert mb.n_response_tokens == 3
    truncating = BatchingConfig(max_prompt_tokens=8, truncate_prompt_left=True)
    assert keep_usable(pairs[2:4], truncating)[1] == {}


def test_rows_with_one_prompt_go_together_and_the_budget_counts_the_prompt_once():
    a, b = [1, 2, 3, 4], [9] * 10
    ts = [tr(a, [5, 6], index=0), tr(b, [7, 8], index=1), tr(a, [6, 5], index=2), tr(a, [5, 5], index=3)]
    # Shared: prompt a once + three 2-token responses = 10 tokens, b's row 12; under a budget of 12 they split.
    shared = make_micro_batches(ts, [1.0] * 4, BatchingConfig(max_tokens_per_micro_batch=12), PAD)
    assert [mb.index for mb in shared] == [[0, 2, 3], [1]]
    assert shared[0].input_ids[:, :4].tolist() == [a] * 3
    # Rows counted whole (6, 12, 6, 6 tokens): the same budget fits two of a's rows.
    whole = make_micro_batches(ts, [1.0] * 4, BatchingConfig(max_tokens_per_micro_batch=12), PAD, share_prompts=False)
    assert [mb.index for mb in whole] == [[0, 2], [3], [1]]
    assert all(mb.input_ids.numel() <= 12 for mb in whole)


def test_groups_whose_prompts_start_alike_share_one_micro_batch_and_count_the_common_start_once():
    # An agent's calls share their system prompt and worked examples, then differ in the question: groups a and b
    # (prompts of 8 tokens, the first 6 common) with two 2-token responses each. Apart: 2 groups x 12 = 24 tokens;
    # packed as one sequence: 6 + (12 - 6) + (12 - 6) = 18.
    system = [3, 1, 4, 1, 5, 9]
    a, b = system + [2, 6], system + [5, 3]
    ts = [tr(a, [7, 7], index=0), tr(b, [8, 8], index=1), tr(a, [7, 8], index=2), tr(b, [8, 7], index=3)]
    assert layout_tokens([12, 12], common_prefix([a, b])) == (18, True)
    (both,) = make_micro_batches(ts, [1.0] * 4, BatchingConfig(max_tokens_per_micro_batch=18), PAD)
    assert both.index == [0, 2, 1, 3] and not both.over_budget
    # One token less and they no longer fit together: each group alone (12 tokens)
    apart = make_micro_batches(ts, [1.0] * 4, BatchingConfig(max_tokens_per_micro_batch=17), PAD)
    assert [mb.index for mb in apart] == [[0, 2], [1, 3]]
    # Prompts with nothing in common: one sequence costs what the padded groups do (24), and they stay apart
    assert layout_tokens([12, 12], 0) == (24, False)
    assert layout_tokens([12, 4], 0) == (16, True)  # apart 2 x 12 = 24: one unpadded sequence is cheaper
    assert common_prefix([a, b, system[:3]]) == 3 and common_prefix([]) == 0


def test_a_group_over_the_budget_is_split_into_parts_that_each_run_the_prompt():
    ts = [tr([1, 2, 3, 4], [5, 6, 7]) for _ in range(5)]  # the whole group costs 4 + 5 * 3 = 19 tokens
    batches = make_micro_batches(ts, [1.0] * 5, BatchingConfig(max_tokens_per_micro_batch=10), PAD)
    assert [mb.index for mb in batches] == [[0, 1], [2, 3], [4]]  # parts of 10, 10 and 7 tokens


def test_a_group_whose_one_row_is_over_the_budget_stays_whole_and_is_recomputed():
    # The long-context case: a 20-token prompt shared by three 4-token responses; one row alone (24) is over the
    # budget of 16, so no part of the group could fit: it runs once as one 32-token micro-batch, over the budget.
    long = [tr([1] * 20, [5, 6, 7, 8], index=i) for i in range(3)]
    short = [tr([2, 3], [4, 5], index=3 + i) for i in range(2)]  # a group of 2 + 2 * 2 = 6 tokens: fits
    batches = make_micro_batches(long + short, [1.0] * 5, BatchingConfig(max_tokens_per_micro_batch=16), PAD)
    assert [(mb.index, mb.over_budget) for mb in batches] == [([0, 1, 2], True), ([3, 4], False)]
    # A row over the budget counted whole is over it too
    (alone,) = make_micro_batches(long[:1], [1.0], BatchingConfig(max_tokens_per_micro_batch=16), PAD,
                                  share_prompts=False)
    assert alone.over_budget
    # ... and a group split into parts that fit is not (the parts of 7, 10 and 10 tokens above)
    parts = make_micro_batches([tr([1, 2, 3, 4], [5, 6, 7]) for _ in range(5)], [1.0] * 5,
                               BatchingConfig(max_tokens_per_micro_batch=10), PAD)
    assert not any(mb.over_budget for mb in parts)


def test_the_default_budget_is_chosen_for_the_device():
    assert BatchingConfig().max_tokens_per_micro_batch == 0  # chosen for the device
    assert budget_for(BatchingConfig(), "cpu").max_tokens_per_micro_batch == 2048
    assert budget_for(BatchingConfig(), "cuda").max_tokens_per_micro_batch == 4096
    assert budget_for(BatchingConfig(max_tokens_per_micro_batch=512), "cuda").max_tokens_per_micro_batch == 512
    # make_micro_batches without a device takes a CPU's: 2 groups of 1030 tokens do not share a micro-batch
    groups = [tr([g] * 1000, [7] * 10, index=i) for g in (1, 2) for i in range(3)]
    assert len(make_micro_batches(groups, [1.0] * 6, BatchingConfig(), PAD)) == 2
    assert len(make_micro_batches(groups, [1.0] * 6, budget_for(BatchingConfig(), "cuda"), PAD)) == 1


def test_a_micro_batch_moves_whole_and_stays_itself_where_it_is():
    (mb,) = make_micro_batches([tr([1, 2], [3, 4])], [1.0], BatchingConfig(), PAD)
    assert mb.to("cpu") is mb
    moved = mb.to("meta")
    tensors = [f.name for f in dataclasses.fields(mb) if isinstance(getattr(mb, f.name), torch.Tensor)]
    assert {"input_ids", "old_logprobs", "advantages", "temperature"} <= set(tensors)
    assert all(getattr(moved, name).device.type == "meta" for name in tensors)
    assert moved.index == mb.index and moved.over_budget == mb.over_budget


def test_rows_carry_their_sampling_temperature():
    ts = [Transition([1, 2], [3], [-0.1], None, "a", "r", "t", i, "s", temperature=temp)
          for i, temp in enumerate([0.7, 0.0, 1.0])]
    (mb,) = make_micro_batches(ts, [1.0] * 3, BatchingConfig(), PAD)
    assert_close(mb.temperature, torch.tensor([0.7, 0.0, 1.0])[mb.index])
    default = MicroBatch(mb.input_ids, mb.attention_mask, mb.response_mask, mb.old_logprobs, mb.advantages, mb.index)
    assert default.temperature.tolist() == [1.0, 1.0, 1.0]
