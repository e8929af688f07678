"Memory banks: greedy semantic de-duplication, the append-only guideline bank, persistence, and the real MiniLM."
import json
import logging
import os

import numpy as np
import pytest

from tmas_nb.methods.memory import (
    RSE_DEDUP_THRESHOLD, TMAS_DEDUP_THRESHOLD, ExperienceBank, GuidelineBank, HashingEmbedder, MemoryItem, RSEBank,
    deduplicate, default_embedder, minilm_dir)


class TableEmbedder:
    "Vectors looked up from a table (made unit length), recording every call; for tests of the ordering logic."
    def __init__(self, table):
        self.table, self.calls = table, []

    def __call__(self, texts):
        self.calls.append(list(texts))
        v = np.array([self.table[t] for t in texts], dtype=np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)


def unit(angle_deg):
    "A 2-d unit vector; the cosine between unit(a) and unit(b) is cos(a - b)."
    a = np.deg2rad(angle_deg)
    return [float(np.cos(a)), float(np.sin(a))]


def never(texts):
    raise AssertionError('no similarity should be needed here')


# ---------------------------------------------------------------- de-duplication

def test_exact_duplicates_keep_the_newest_round():
    kept, log = deduplicate([('Check the base case.', 0), ('check the  base CASE.', 3), ('Check the base case.', 1)],
                            tau=0.7, embedder=never)
    assert kept == [MemoryItem('check the  base CASE.', 3)]
    assert [(m.round, m.reason, m.head_round, m.similarity) for m in log] == [(0, 'exact', 3, 1.0), (1, 'exact', 3, 1.0)]


def test_substring_merges_into_head():
    kept, log = deduplicate([('AM-GM', 2), ('Apply AM-GM to the three positive terms.', 2)], tau=0.99, embedder=never)
    assert [k.text for k in kept] == ['Apply AM-GM to the three positive terms.']
    assert (log[0].text, log[0].head, log[0].reason) == ('AM-GM', 'Apply AM-GM to the three positive terms.', 'substring')


def test_substring_only_into_an_existing_head():
    # the newer short item becomes a head first; the older, longer item contains it but is not its substring
    emb = TableEmbedder({'AM-GM': unit(0), 'Apply AM-GM to the terms.': unit(80)})
    kept, log = deduplicate([('Apply AM-GM to the terms.', 0), ('AM-GM', 1)], tau=0.7, embedder=emb)
    assert [k.text for k in kept] == ['AM-GM', 'Apply AM-GM to the terms.'] and log == []


def test_threshold_is_strict_and_configurable():
    emb = TableEmbedder({'a': unit(0), 'b': unit(40)})          # cosine 0.766
    sim = float(np.cos(np.deg2rad(40)))
    assert len(deduplicate([('a', 0), ('b', 0)], tau=TMAS_DEDUP_THRESHOLD, embedder=emb)[0]) == 1
    assert len(deduplicate([('a', 0), ('b', 0)], tau=RSE_DEDUP_THRESHOLD, embedder=emb)[0]) == 2
    kept, log = deduplicate([('a', 0), ('b', 0)], tau=sim - 1e-4, embedder=emb)
    assert len(kept) == 1 and log[0].reason == 'similarity' and log[0].similarity == pytest.approx(sim, abs=1e-4)
    assert len(deduplicate([('a', 0), ('b', 0)], tau=sim + 1e-4, embedder=emb)[0]) == 2


def test_order_newest_round_first_then_longest_first():
    # 'long old' is close to both newer items; whichever is processed first becomes the head
    table = {'new': unit(0), 'newer and longer': unit(30), 'old but by far the longest text': unit(15)}
    emb = TableEmbedder(table)
    kept, log = deduplicate([('old but by far the longest text', 0), ('new', 1), ('newer and longer', 1)],
                            tau=0.8, embedder=emb)
    # order of processing: round 1 longest ('newer and longer'), round 1 ('new', cos 30° = 0.87 -> merges),
    # round 0 ('old ...', cos 15° = 0.97 -> merges)
    assert [k.text for k in kept] == ['newer and longer']
    assert [(m.text, m.head) for m in log] == [('new', 'newer and longer'),
                                               ('old but by far the longest text', 'newer and longer')]
    assert len(emb.calls) == 1, 'all embeddings are computed in one batch'
    # ties in round: longer text first; unrelated items keep that order
    emb2 = TableEmbedder({'aa': unit(0), 'bbbb': unit(90), 'c': unit(180)})
    kept, _ = deduplicate([('aa', 5), ('c', 5), ('bbbb', 5)], tau=0.7, embedder=emb2)
    assert [k.text for k in kept] == ['bbbb', 'aa', 'c']


def test_merges_into_most_similar_head():
    emb = TableEmbedder({'h1 long text': unit(0), 'h2 longer text!': unit(90), 'x': unit(75)})
    kept, log = deduplicate([('h1 long text', 1), ('h2 longer text!', 1), ('x', 0)], tau=0.7, embedder=emb)
    assert [k.text for k in kept] == ['h2 longer text!', 'h1 long text'] and log[0].head == 'h2 longer text!'


def test_bad_items_are_reported():
    with pytest.raises(ValueError, match='item 1'):
        deduplicate([('ok', 0), ('no round', 'x')], tau=0.7, embedder=never)
    assert deduplicate([('  ', 0), ('', 1)], tau=0.7, embedder=never) == ([], [])


# ---------------------------------------------------------------- banks

def test_experience_bank_merge_and_replace():
    b = ExperienceBank(embedder=HashingEmbedder())
    assert b.tau == TMAS_DEDUP_THRESHOLD and RSEBank().tau == RSE_DEDUP_THRESHOLD
    b.update(['The roots are 2 and -2.'], ['Check negative roots.'], round=0)
    ev = b.update(['the roots are 2 and -2.', 'The discriminant is 16.'], ['check NEGATIVE roots.'], round=1)
    assert ev.added == {'anchors': ['The discriminant is 16.'], 'heuristics': []}
    # incremental: the admitted item stays as it was (text and round); the restatement merges into it
    assert [(x.text, x.round) for x in b.anchors] == [('The roots are 2 and -2.', 0), ('The discriminant is 16.', 1)]
    ev = b.update(['The discriminant is 16.'], [], round=2, replace=True)
    assert ev.removed == {'anchors': ['The roots are 2 and -2.'], 'heuristics': ['Check negative roots.']}
    assert [(x.text, x.round) for x in b.anchors] == [('The discriminant is 16.', 1)] and b.heuristics == []
    assert len(b.events) == 3


def test_guideline_bank_is_append_only(caplog):
    g = GuidelineBank()
    g.update(['Induction on n.', 'Coordinates.', 'Look modulo 3.'], round=0)
    with caplog.at_level(logging.WARNING, logger='tmas_nb.methods.memory'):
        ev = g.update(['Look modulo 3.', 'Complex coordinates with the unit circle.', 'Pigeonhole.'], round=1)
    # dropped 'Induction on n.', rewrote 'Coordinates.' -> both restored; the rewrite is appended as new
    assert g.texts() == ['Induction on n.', 'Coordinates.', 'Look modulo 3.',
                         'Complex coordinates with the unit circle.', 'Pigeonhole.']
    assert [(r['text'], r['reason'], r['replaced_by']) for r in ev.restored] == [
        ('Induction on n.', 'dropped', None),
        ('Coordinates.', 'rewritten', 'Complex coordinates with the unit circle.')]
    assert ev.added == ['Complex coordinates with the unit circle.', 'Pigeonhole.']
    assert not ev.compliant and g.events[-1] is ev
    assert 'restored' in caplog.text and 'Induction on n.' in caplog.text
    # an empty or garbage proposal changes nothing and restores everything
    before = g.texts()
    ev = g.update([], round=2)
    assert g.texts() == before and len(ev.restored) == len(before) and ev.added == []
    # reordering is noted, never applied
    ev = g.update(list(reversed(before)), round=3)
    assert g.texts() == before and ev.reordered and not ev.restored and not ev.compliant
    # a compliant update only appends
    ev = g.update(before + ['Extremal principle.'], round=4)
    assert ev.compliant and ev.added == ['Extremal principle.'] and g.strategies[-1] == MemoryItem('Extremal principle.', 4)
    assert [s.round for s in g.strategies] == [0, 0, 0, 1, 1, 4]


@pytest.mark.parametrize('cls,kw', [(ExperienceBank, dict(anchors=['a1', 'a2 long'], heuristics=['h1'])),
                                    (RSEBank, dict(propositions=['p1'], pitfalls=['f1', 'f2']))])
def test_save_load_round_trip_and_atomic(tmp_path, cls, kw):
    b = cls(embedder=HashingEmbedder())
    b.update(**kw, round=0)
    b.update(**{k: [v[0] + ' again'] for k, v in kw.items()}, round=1)
    path = tmp_path / 'run' / 'problem_3' / f'{cls.__name__}.json'
    for _ in range(3):                                    # once per iteration, overwriting
        b.save(path)
    assert os.listdir(path.parent) == [path.name], 'no temporary files may be left behind'
    b2 = cls.load(path, embedder=HashingEmbedder())
    assert b2.to_dict() == b.to_dict() and b2.tau == b.tau
    assert json.loads(path.read_text())['kind'] == cls.__name__
    assert cls.resume(path).snapshot() == b.snapshot()
    assert len(cls.resume(tmp_path / 'none.json')) == 0
    # the snapshot is plain JSON
    assert json.loads(json.dumps(b.snapshot())) == b.snapshot()


def test_guideline_save_load_and_resume(tmp_path):
    g = GuidelineBank()
    g.update(['A.', 'B.'], round=0)
    g.update(['B.', 'C.'], round=1)
    p = g.save(tmp_path / 'g.json')
    g2 = GuidelineBank.resume(p)
    assert g2.to_dict() == g.to_dict() and g2.events[1].restored[0]['text'] == 'A.'
    g2.update(['A.', 'B.', 'C.', 'D.'], round=2)
    assert g2.texts() == ['A.', 'B.', 'C.', 'D.'] and os.listdir(tmp_path) == ['g.json']


def test_load_errors_name_file_and_field(tmp_path):
    p = tmp_path / 'bank.json'
    with pytest.raises(FileNotFoundError, match='resume'):
        ExperienceBank.load(p)
    p.write_text('{"kind": "ExperienceBank", "anchors": [{"text": "ok", "round": 0}, {"text": "bad"}]}')
    with pytest.raises(ValueError, match=r'bank\.json.*anchors\[1\]'):
        ExperienceBank.load(p)
    with pytest.raises(ValueError, match="expected 'GuidelineBank'"):
        GuidelineBank.load(p)
    p.write_text('{"kind": ')
    with pytest.raises(ValueError, match='not valid JSON'):
        RSEBank.load(p)


# ---------------------------------------------------------------- the real all-MiniLM-L6-v2

def test_real_minilm_paraphrases_merge_unrelated_do_not():
    assert (minilm_dir() / 'model.safetensors').exists()
    emb = default_embedder()
    v = emb(['Check the base case n = 1 before the induction step.', 'Verify the induction base case n=1 first.'])
    assert v.shape == (2, 384) and np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-4)
    items = [('Check the base case n = 1 before the induction step.', 1),
             ('Verify the induction base case n=1 first.', 2),
             ('Apply the AM-GM inequality to bound the sum from below.', 1),
             ('Bound the sum below using the arithmetic-geometric mean inequality.', 1),
             ('Substitute x = tan t to simplify the integral.', 1),
             ('The triangle is isosceles, so its base angles are equal.', 0)]
    kept, log = deduplicate(items, tau=TMAS_DEDUP_THRESHOLD)
    # newest round first, then longest first; the two paraphrase pairs merge into their first member
    assert [k.text for k in kept] == ['Verify the induction base case n=1 first.',
                                      'Bound the sum below using the arithmetic-geometric mean inequality.',
                                      'Substitute x = tan t to simplify the integral.',
                                      'The triangle is isosceles, so its base angles are equal.']
    merged = {m.text: m for m in log}
    assert set(merged) == {'Check the base case n = 1 before the induction step.',
                           'Apply the AM-GM inequality to bound the sum from below.'}
    assert all(m.reason == 'similarity' and m.similarity > TMAS_DEDUP_THRESHOLD for m in log)
    # the AM-GM pair (cosine about 0.75) stays apart at the stricter RSE threshold; the base-case pair does not
    kept, log = deduplicate(items, tau=RSE_DEDUP_THRESHOLD)
    assert len(kept) == 5 and [m.text for m in log] == ['Check the base case n = 1 before the induction step.']
    # the bank uses the same model by default
    b = RSEBank()
    b.update(['The only real root of the cubic is x = 2.', 'The cubic has exactly one real root, namely x = 2.'],
             ['Dividing both sides by x loses the solution x = 0.'], round=0)
    # admission is incremental and in arrival order: the first of the two paraphrases is admitted, the second merges
    assert b.texts('propositions') == ['The only real root of the cubic is x = 2.']
    assert b.events[0].merged['propositions'][0].reason == 'similarity' and len(b.pitfalls) == 1
