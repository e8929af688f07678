"""`tmas replay show`: the episode behind the picture is the environment's, the PNG is a real image, controller files
run in the sandbox (never here), and two controllers stand side by side."""
import builtins
import textwrap

import matplotlib as mpl
import pytest
from PIL import Image
from matplotlib.text import Text

from tmas_nb.cli import main
from tmas_nb.autotts.authors_api import example_controller
from tmas_nb.autotts.controllers import parse_controller
from tmas_nb.autotts.environment import ReplayEnv
from tmas_nb.autotts.show import (
    DPI, FileOptions, draw_episodes, episode, episode_branches, episode_reads, file_episode, show_episodes,
    spec_episode, vote_timeline)
from tmas_nb.autotts.store import load_store

MODEL, BENCH = 'Qwen3-4B', 'aime24'


@pytest.fixture(scope='module')
def store(data_root):
    return load_store(MODEL, BENCH, data_root)


@pytest.fixture(scope='module')
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp('controllers')
    for name in ('ours_cmc', 'authors_cmc'): (d / f'{name}.py').write_text(example_controller(name)[1])
    return d


@pytest.fixture(scope='module')
def authors_cmc(store, files):
    "The authors'-API CMC example on question 2, seed 1, run in the sandbox."
    return file_episode(files / 'authors_cmc.py', store, 2, 1, config={'beta': 0.5})


def drawn_rows(ax) -> int:
    "Branches drawn in an upper panel: its lines tagged `branch <i>`."
    return sum(str(l.get_gid()).startswith('branch ') for l in ax.lines)


@pytest.mark.parametrize('spec,question,seed', [('cmc:beta=0.5', 3, 1), ('pp:num_chains=16', 16, 0), ('sc:k=8', 1, 2)])
def test_the_picture_is_the_environments_episode(store, spec, question, seed):
    env = ReplayEnv(store, question, seed=seed)
    answer = parse_controller(spec).run(env)
    ep = spec_episode(spec, store, question, seed)
    assert (ep.answer, ep.cost, ep.correct) == (answer, env.cost, answer == store.gold_answers[question])
    br = episode_branches(ep)
    assert len(br) == env.m
    assert br.pruned.tolist() == env.pruned and br.finished.tolist() == [env.finished(i) for i in range(env.m)]
    assert br.tokens.tolist() == [float(t) for t in env.tokens_read]
    fig = draw_episodes([ep])
    assert drawn_rows(fig.axes[0]) == env.m
    fig.draw_without_rendering()                        # ticks and legends exist once drawn
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    assert texts and min(t.get_fontsize() for t in texts) >= 9     # readable at the saved size
    assert not [t.get_text() for t in texts if 'nan' in t.get_text().lower()]
    assert spec.split(':')[0] in fig.axes[0].get_title('left') and f'question {question} · seed {seed}' in fig._suptitle.get_text()
    # every interval read is the store's probe at that depth of the seed's branch, marked correct iff it is the gold one
    rd = episode_reads(ep); order = store.orders([seed])[0, question]
    iv = rd[rd.kind == 'interval']; depth = iv.groupby('branch').cumcount()
    ids = [int(store.probes[question, order[b], d]) for b, d in zip(iv.branch, depth)]
    assert iv.answer.tolist() == [store.answer(question, a) for a in ids]
    assert (iv.status == 'correct').tolist() == [a == store.gold[question] for a in ids]
    fin = rd[rd.kind == 'final']
    assert fin.answer.tolist() == [store.answer(question, int(store.finals[question, order[b]])) for b in fin.branch]
    assert vote_timeline(ep).spent.iloc[-1] == env.cost


def test_cli_writes_a_png_of_the_expected_size_and_a_summary(data_root, store, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(mpl.rcParams, 'savefig.bbox', 'tight')   # a report's style in the same process must not crop it
    out = tmp_path / 'pics' / 'two.png'
    argv = ['replay', 'show', '--data-dir', str(data_root), '--model', MODEL, '--benchmark', BENCH, '--question', '0']
    assert main(argv + ['--controller', 'cmc:beta=0.5', '--controller', 'asc:max_samples=16,threshold=0.95', '--seed', '0',
                        '--png', str(out)]) == 0        # --controller twice: side by side
    text = capsys.readouterr().out
    assert text.count(' on Qwen3-4B/aime24, question 0 (gold 204), seed 0') == 2
    assert 'answer 204 (correct)' in text and f'picture: {out}' in text and 'nan' not in text
    with Image.open(out) as im: im.verify()
    with Image.open(out) as im: w, h = im.size; fmt = im.format
    fig = draw_episodes([spec_episode('cmc:beta=0.5', store, 0, 0), spec_episode('asc:max_samples=16,threshold=0.95', store, 0, 0)])
    assert fmt == 'PNG' and (w, h) == (round(fig.get_figwidth() * DPI), round(fig.get_figheight() * DPI)) and w > h
    assert out.stat().st_size < 200_000
    monkeypatch.chdir(tmp_path)                      # without --png: a default path, named on the last line
    assert main(argv + ['--controller', 'sc:k=2']) == 0
    path = capsys.readouterr().out.strip().splitlines()[-1].removeprefix('picture: ')
    assert path.startswith('replay_show/') and (tmp_path / path).is_file()


def test_cli_errors_are_one_line(data_root, capsys):
    base = ['replay', 'show', '--data-dir', str(data_root), '--model', MODEL, '--benchmark', BENCH]
    assert main(base + ['--controller', 'sc:k=4', '--question', '30']) == 2
    assert 'has questions 0..29' in capsys.readouterr().err
    assert main(base + ['--controller', 'sc:k=999']) == 2
    assert '--controller sc:k=999' in capsys.readouterr().err
    assert main(base + ['--controller', 'sc:k=4', '--png', 'x.jpg']) == 2
    assert 'must end in .png' in capsys.readouterr().err
    assert main(base + ['--controller', 'x.py', '--controller-config', '{beta: 1}']) == 2
    assert '--controller-config: not valid JSON' in capsys.readouterr().err


def test_file_controllers_run_in_the_sandbox_and_replay_to_the_same_episode(store, authors_cmc, tmp_path):
    ep = spec_episode('cmc:beta=0.5', store, 2, 1)
    # an ours-API file: the built-in CMC, subclassed, with an import-time side effect that must not happen here
    hostile = tmp_path / 'my_cmc.py'
    hostile.write_text(textwrap.dedent('''
        import builtins
        builtins.TMAS_CONTROLLER_RAN_HERE = True
        from tmas_nb.autotts.controllers import CMC
        class MyCMC(CMC):
            name = 'my_cmc'
    '''))
    ours = episode(str(hostile), store, 2, 1, FileOptions(config={'beta': 0.5}))
    assert not hasattr(builtins, 'TMAS_CONTROLLER_RAN_HERE')          # the file ran in the sandboxed child only
    cols = ['action', 'branch', 'answer', 'cost', 'finished']       # replayed on the environment itself: the same steps
    assert ours.steps[cols].values.tolist() == ep.steps[cols].astype({'branch': int, 'cost': float}).values.tolist()
    for fe in (ours, authors_cmc):
        assert fe.ran_in.startswith('sandbox') and (fe.answer, fe.correct, fe.cost) == (ep.answer, ep.correct, ep.cost)
        assert len(episode_branches(fe)) == len(episode_branches(ep)) == drawn_rows(draw_episodes([fe]).axes[0])
    assert 'authors API' in authors_cmc.ran_in and 'ours API' in ours.ran_in


def test_two_controllers_side_by_side(data_root, store, authors_cmc):
    pp = spec_episode('pp:num_chains=8', store, 2, 1)
    fig = draw_episodes([pp, authors_cmc])
    assert len(fig.axes) == 4
    titles = [fig.axes[0].get_title('left'), fig.axes[1].get_title('left')]
    assert titles[0].startswith('pp:num_chains=8') and 'authors_cmc.py' in titles[1] and 'sandbox' in titles[1]
    assert 'question 2 · seed 1' in fig._suptitle.get_text() and MODEL in fig._suptitle.get_text()
    assert [drawn_rows(fig.axes[0]), drawn_rows(fig.axes[1])] == [len(episode_branches(pp)), len(episode_branches(authors_cmc))]
    assert len(show_episodes(['sc:k=2', 'sc:k=3'], MODEL, BENCH, 0, 0, data_root).axes) == 4
    with pytest.raises(ValueError, match='share store, question and seed'):
        draw_episodes([spec_episode('sc:k=4', load_store(MODEL, BENCH, data_root), 0, 0),
                       spec_episode('sc:k=4', load_store(MODEL, BENCH, data_root), 1, 0)])
