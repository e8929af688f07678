"""The TMAS hybrid-RL rewards on hand-computed cases: the novelty table, the experience-utilisation bonus and its
p_base edge cases, correctness with truncated outputs, length checks, the novelty judges and the TRL adapters."""
import asyncio

import pytest

from tmas_nb.llm.core import LLM, Completion
from tmas_nb.rl.rewards import (
    NOVELTY_REWARDS, CorrectnessReward, CosineNoveltyJudge, ExperienceUtilizationReward, LLMNoveltyJudge,
    NoveltyReward, correctness_reward, experience_utilization_rewards, novelty_reward, strategy_statement)

BASE4_BANK4 = ['base'] * 4 + ['bank'] * 4


def test_novelty_table_is_the_papers():
    assert NOVELTY_REWARDS == {(True, True): 1.0, (True, False): 0.2, (False, True): -0.5, (False, False): -1.0}
    assert [novelty_reward(c, n) for c in (True, False) for n in (True, False)] == [1.0, 0.2, -0.5, -1.0]


@pytest.mark.parametrize('correct, beta, expected', [
    # p_base = 1/4: a correct bank rollout gets 1 + 0.6 * 3/4 = 1.45
    ([1, 0, 0, 0, 1, 1, 0, 0], 0.6, [1, -1, -1, -1, 1.45, 1.45, -1, -1]),
    # p_base = 0: the full bonus 1 + beta
    ([0, 0, 0, 0, 1, 0, 0, 1], 0.5, [-1, -1, -1, -1, 1.5, -1, -1, 1.5]),
    # p_base = 1: no bonus at all
    ([1, 1, 1, 1, 1, 0, 1, 0], 0.6, [1, 1, 1, 1, 1, -1, 1, -1]),
    # p_base = 1/2, beta = 1: 1.5
    ([1, 1, 0, 0, 0, 1, 0, 0], 1.0, [1, 1, -1, -1, -1, 1.5, -1, -1]),
])
def test_experience_bonus_arithmetic(correct, beta, expected):
    assert experience_utilization_rewards(correct, BASE4_BANK4, beta) == pytest.approx(expected)


def test_p_base_edge_cases():
    with pytest.raises(ValueError, match='p_base is undefined'):
        experience_utilization_rewards([True, False], ['bank', 'bank'])
    assert experience_utilization_rewards([True, False], ['base', 'base']) == [1.0, -1.0]   # no bank rollout: plain
    assert experience_utilization_rewards([False, True], ['base', 'bank']) == [-1.0, 1.6]   # one base rollout, wrong
    with pytest.raises(ValueError, match="'base' or 'bank'"):
        experience_utilization_rewards([True, True], ['base', 'with_bank'])


def test_length_mismatch_names_both_lengths():
    with pytest.raises(ValueError, match='correct has 3 items but group has 2'):
        experience_utilization_rewards([True, False, True], ['base', 'bank'])
    with pytest.raises(ValueError, match='completions has 2 items but gold has 3'):
        correctness_reward(['\\boxed{1}', '\\boxed{2}'], ['1', '2', '3'])
    with pytest.raises(ValueError, match='completions has 1 items but finish_reasons has 2'):
        correctness_reward(['\\boxed{1}'], ['1'], ['stop', 'stop'])


def test_correctness_uses_the_grader_and_truncation_is_wrong():
    got = correctness_reward([r'so \boxed{\frac{1}{2}}', 'The answer is 0.5', r'\boxed{3}', '', r'\boxed{0.5}'],
                             ['1/2', '1/2', '1/2', '1/2', '1/2'], ['stop', 'stop', 'stop', 'stop', 'length'])
    assert got == [1.0, 1.0, -1.0, -1.0, -1.0]
    # TRL's conversational completions are lists of messages
    assert correctness_reward([[{'role': 'assistant', 'content': r'\boxed{7}'}]], ['7']) == [1.0]


def test_correctness_adapter_marks_filled_completions_as_truncated_and_logs_halves():
    logged = {}
    r = CorrectnessReward(max_completion_length=3, eos_token_ids=[9])(
        ['p'] * 4, [r'\boxed{4}'] * 4, ['4'] * 4, completion_ids=[[1, 9], [1, 2, 3], [1, 2, 9], [5]],
        half=['base', 'base', 'bank', 'bank'], log_metric=logged.__setitem__)
    assert r == [1.0, -1.0, 1.0, 1.0]
    assert logged == {'accuracy/base': 0.5, 'accuracy/bank': 1.0}


def test_experience_adapter_groups_by_problem():
    comps = [r'\boxed{1}', r'\boxed{0}', r'\boxed{1}', r'\boxed{1}', r'\boxed{2}', r'\boxed{0}', r'\boxed{0}', r'\boxed{2}']
    got = ExperienceUtilizationReward(beta=0.6)(['p'] * 8, comps, ['1'] * 4 + ['2'] * 4,
                                                half=['base', 'base', 'bank', 'bank'] * 2, problem_id=['a'] * 4 + ['b'] * 4)
    # problem a: p_base = 1/2 -> 1.3; problem b: p_base = 1/2 -> 1.3
    assert got == pytest.approx([1, -1, 1.3, 1.3, 1, -1, -1, 1.3])
    assert ExperienceUtilizationReward()(['p'], comps[:1], ['1'], half=['base'], problem_id=['a'], objective=['novelty']) == [None]


def test_strategy_statement():
    assert strategy_statement('...\\boxed{2}\n**Strategy:** induction on n') == 'induction on n'
    assert strategy_statement('no strategy line') is None


class NewIfInvariant(LLM):
    """Control flow only: answers NEW when the proposed strategy mentions an invariant."""
    def __init__(self):
        super().__init__('scripted'); self.calls = 0

    async def _generate(self, requests):
        self.calls += len(requests)
        return [[Completion(text='NEW' if 'Proposed strategy: an invariant' in r.messages[-1]['content'] else 'SEEN')]
                for r in requests]


def test_llm_judge_and_its_cache():
    llm = NewIfInvariant()
    judge = LLMNoveltyJudge(llm)
    bank = ['induction on n']
    got = asyncio.run(judge.judge(['an invariant mod 3', 'induction again', 'an invariant mod 3', None, 'x'], [bank] * 4 + [[]]))
    assert got == [True, False, True, False, True]
    assert llm.calls == 2          # the repeated question came from the cache; None and the empty bank need no call


def test_novelty_adapter_is_async_and_uses_the_table():
    reward = NoveltyReward(LLMNoveltyJudge(NewIfInvariant()))
    comps = ['\\boxed{1}\nStrategy: an invariant', '\\boxed{1}\nStrategy: induction', '\\boxed{0}\nStrategy: an invariant', '\\boxed{0}']
    got = asyncio.run(reward(['p'] * 4, comps, ['1'] * 4, guidelines=[['induction']] * 4))
    assert got == [1.0, 0.2, -0.5, -1.0]


def test_minilm_cosine_judge():
    judge = CosineNoveltyJudge(tau=0.7)
    bank = ['use induction on n', 'place the triangle in coordinates and compute the side lengths']
    sims = judge.similarities('prove the statement by induction on n', bank)
    assert sims[0] > 0.7 > sims[1]
    assert judge.is_new('prove the statement by induction on n', bank) is False
    assert judge.is_new('look for an invariant modulo 3', bank) is True
    assert judge.is_new(None, bank) is False and judge.is_new('anything', []) is True


# ------------------------------------------------------------------ one mixed batch, and a judge that reads the rollout

def test_hybrid_rewards_routes_each_row_of_a_mixed_batch_to_its_objective():
    from tmas_nb.rl.rewards import hybrid_rewards
    objectives = ['standard', 'exp_util', 'exp_util', 'exp_util', 'novelty', 'exp_util', 'novelty', 'standard']
    correct = [True, True, False, True, True, True, False, False]
    groups = [None, 'base', 'base', 'bank', None, 'bank', None, None]
    novel = [None, None, None, None, False, None, True, None]
    # problem p: base 1 of 2 right -> p_base 1/2, a right bank rollout 1 + 0.6 * 0.5
    got = hybrid_rewards(objectives, correct, groups, novel, problems=['s', 'p', 'p', 'p', 'n', 'p', 'n', 't'], beta=0.6)
    assert got == pytest.approx([1.0, 1.0, -1.0, 1.3, 0.2, 1.3, -0.5, -1.0])
    with pytest.raises(ValueError, match="rollout 2: objective 'guideline' is unknown"):
        hybrid_rewards(['standard', 'novelty', 'guideline'], [1, 1, 1], [None] * 3, [None, True, None])
    with pytest.raises(ValueError, match="rollout 1 \\(exp_util, problem 'q'\\): p_base is undefined"):
        hybrid_rewards(['exp_util', 'exp_util'], [1, 1], ['base', 'bank'], [None] * 2, problems=['p', 'q'])


def test_the_judge_reads_the_solution_when_the_strategy_line_lies():
    from tmas_nb.rl.rewards import RolloutNoveltyJudge, solution_strategy
    bank = ['prove the statement by induction on n']
    liar = ("We prove the statement by induction on n. The base case n = 1 holds, and the step from n to n + 1 adds "
            "one term to both sides. Hence \\boxed{12}.\nStrategy: look for an invariant modulo 3")
    honest = ("Look for an invariant modulo 3: every move keeps the sum of the piles fixed mod 3. So the final pile is "
              "\\boxed{12}.\nStrategy: look for an invariant modulo 3")
    self_report = CosineNoveltyJudge(tau=0.7)
    assert self_report.is_new(strategy_statement(liar), bank) is True       # the old reading believes the line
    judge = RolloutNoveltyJudge(tau=0.7)                                     # MiniLM on the strategy the solution shows
    assert 'induction on n' in solution_strategy(liar) and 'invariant' not in solution_strategy(liar)
    assert asyncio.run(judge.judge(['q', 'q'], [liar, honest], [bank, bank])) == [False, True]
