"""Controllers live through a server: `tmas serve`'s application on 127.0.0.1 with SmolLM2-135M, driven by the live
environment (one seeded /v1/completions request per interval, greedy probes, a batch's requests in flight together)
and by `tmas run --method controller --backend openai --base-url URL`, checked against replay of the store that
`tmas replay build --base-url URL --chunked` writes through the same server with the same settings and seeds."""
import json, shutil

import pytest

from tmas_nb.data.benchmarks import demo_problems
from tmas_nb.llm.openai_backend import OpenAIBackend
from tmas_nb.llm.server import ServerThread
from tmas_nb.llm.transformers_backend import TransformersBackend
from tmas_nb.cli import main
from tmas_nb.autotts.build import BuildSettings, sidecar_path
from tmas_nb.autotts.controllers import parse_controller
from tmas_nb.autotts.environment import ReplayEnv
from tmas_nb.autotts.live_server import ServerLiveEnv, ServerLiveModel
from tmas_nb.autotts.store import load_store_file
from tmas_nb.runs.folder import load_run

MODEL = 'smollm2'
S = BuildSettings(branches=2, probe_every=8, max_new_tokens=16, seed=0)
FLAGS = ['--benchmark', 'demo', '--limit', '1', '--branches', '2', '--probe-every', '8', '--max-new-tokens', '16']


@pytest.fixture(scope='module')
def served(tmp_path_factory):
    import torch
    torch.set_num_threads(1)
    llm = TransformersBackend(MODEL, device='cpu')
    with ServerThread(llm, served_model_name=MODEL) as srv:
        out = tmp_path_factory.mktemp('chunked') / 'c.json'          # the reference: built through the same server, chunked
        assert main(['replay', 'build', '--base-url', srv.base_url, '--model', MODEL, *FLAGS, '--chunked', '--out', str(out), '--quiet']) == 0
        yield srv, load_store_file(out), out
    llm.close()


def replay(store, spec):
    env = ReplayEnv(store, 0, seed=None, record=True)
    return parse_controller(spec).run(env), env


def steps(env): return [(s.action, s.branch, s.answer, s.cost) for s in env.trace]


def test_live_through_the_server_equals_replay_of_the_chunked_store(served):
    srv, store, out = served
    assert json.loads(sidecar_path(out).read_text())['decode'] == 'chunked'
    live = ServerLiveModel(OpenAIBackend(MODEL, base_url=srv.base_url, discover=False), S)
    try:
        srv.app.state.counts['peak_in_flight'] = 0
        env = ServerLiveEnv(question=0, live=live, text=demo_problems()[0].question, width=2, record=True)
        a = parse_controller('cmc:beta=0.5').run(env)
        a_rep, rep = replay(store, 'cmc:beta=0.5')
        assert (a, env.cost, env.depth, env.pruned, steps(env)) == (a_rep, rep.cost, rep.depth, rep.pruned, steps(rep))
        u = env.usage()
        assert u['tokens_charged'] == rep.cost and u['probe_tokens'] > 0 and u['probe_calls'] > 0
        # the two branches advance together: their requests are in flight at once, one round per interval
        assert env.rounds[0] == 2 and srv.app.state.counts['peak_in_flight'] >= 2
        assert u['request_rounds'] < u['branch_requests']
    finally: live.close()


def test_tmas_run_controller_through_the_server_and_its_call_cache(served, tmp_path, capsys):
    srv, store, _ = served
    run = ['run', '--method', 'controller', '--controller', 'sc:k=2', '--backend', 'openai', '--base-url', srv.base_url,
           '--model', MODEL, *FLAGS, '--quiet']
    assert main([*run, '--out', str(tmp_path / 'r')]) == 0
    r = load_run(tmp_path / 'r')
    [rec] = r.records.to_dict('records')
    s = json.loads(rec['summary'])
    a_rep, rep = replay(store, 'sc:k=2')
    assert (s['answer'], s['tokens_charged'], s['tokens_generated']) == (a_rep, rep.cost, rep.cost)   # SC reads all it decodes
    assert rec['completion_tokens'] == s['tokens_generated'] + s['probe_tokens'] and s['branch_requests'] >= 2
    by_role = r.summary()['tokens_by_role']
    assert by_role['branch'] == s['tokens_generated'] and by_role['probe'] == s['probe_tokens']
    first = json.loads((tmp_path / 'r' / 'status.json').read_text())['last_invocation_cache']
    assert first['misses'] > 0 and first['hits'] == 0
    # resumed from scratch (its checkpoint gone): every request is answered by the run's call cache, the record is the same
    shutil.rmtree(tmp_path / 'r' / 'checkpoints'); (tmp_path / 'r' / 'checkpoints').mkdir()
    before = srv.app.state.counts['requests']
    assert main([*run, '--out', str(tmp_path / 'r')]) == 0
    again = json.loads((tmp_path / 'r' / 'status.json').read_text())['last_invocation_cache']
    assert (again['hits'], again['misses']) == (first['misses'], 0)
    assert srv.app.state.counts['requests'] - before <= 2          # the server is asked only for its model list
    assert json.loads(load_run(tmp_path / 'r').records.summary[0]) == s
    capsys.readouterr()
