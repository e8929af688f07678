"""`tmas data fetch` against a real web server on loopback that serves the shared data laid out like its sources
(`<owner>/<repo>/<commit>/<path>`): clean fetch, re-fetch, corrupted file, server killed mid-download, offline,
local copies, a fresh machine that fetches the replay stores and runs the README's main job, and a bare clone whose main job
(`tmas report autotts_table`) fetches the stores itself on first use, or says in one line that it cannot."""
import hashlib, json, os, socket, subprocess, sys, time
from dataclasses import replace
from pathlib import Path

import pytest

from tmas_nb.cli import main
from tmas_nb.core import sha256_file
from tmas_nb.autotts.discovery import history_files
from tmas_nb.autotts.history import history_curves
from tmas_nb.data.fetch import (
    REGISTRY, ChecksumError, DataFetchError, Downloader, fetch, list_datasets, make_mirror, resolve_names)

HERE = Path(__file__).parent
QUIET = Downloader(retries=0, progress=False)


class Server:
    "`loopback_mirror.py` in its own process: serves `root`, logs requests to `log`, optionally dies mid-body."
    def __init__(self, root, log, port=0, die_after=None):
        cmd = [sys.executable, str(HERE / 'loopback_mirror.py'), str(root), str(log), '--port', str(port)]
        if die_after is not None: cmd += ['--die-after', str(die_after)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())
        self.url, self.log = f'http://127.0.0.1:{self.port}', Path(log)

    def requests(self) -> list[str]: return [l for l in self.log.read_text().splitlines() if l.startswith('GET')] if self.log.exists() else []
    def __enter__(self): return self
    def __exit__(self, *a): self.proc.kill(); self.proc.wait()


def files_under(d: Path) -> list[str]:
    return sorted(p.relative_to(d).as_posix() for p in Path(d).rglob('*') if p.is_file()) if Path(d).exists() else []


def cli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, '-m', 'tmas_nb.cli', *args], capture_output=True, text=True, env=env, timeout=timeout)


def closed_port() -> int:
    s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()
    return port


@pytest.fixture(scope='module')
def mirror(data_root, tmp_path_factory):
    "The shared data laid out like the sources (symlinks in a temporary folder)."
    out = tmp_path_factory.mktemp('mirror')
    make_mirror(out, ['all'], data_root)
    return out


def test_clean_fetch_then_refetch_downloads_nothing(mirror, data_root, tmp_path):
    dest = tmp_path / 'data'
    with Server(mirror, tmp_path / 'log') as s:
        res = fetch(['all'], dest, s.url, downloader=QUIET)
        assert res == {'autotts': {f.path: 'downloaded' for f in REGISTRY['autotts'].files},
                       'imo_answerbench': {'benchmarks/imo_answerbench_v2.csv': 'downloaded'},
                       'hle_math_100': {'benchmarks/hle_math_100.jsonl': 'downloaded'}}
        assert len(s.requests()) == 14
        assert s.requests()[-1].split()[1] == '/WangXinglin/RSE/d36f7e1/data/HLE_MATH_text_100_sample_subset.jsonl'
        for name in res:
            for f in REGISTRY[name].files:
                assert (dest / f.path).read_bytes() == (data_root / f.path).read_bytes()
        assert not [p for p in files_under(dest) if p.endswith('.part')]
        again = fetch(['autotts', 'imo-answerbench'], dest, s.url, downloader=QUIET)
        assert {v for files in again.values() for v in files.values()} == {'present'}
        assert len(s.requests()) == 14                      # nothing asked of the server
    status = {r['name']: r['status'] for r in list_datasets(dest)}
    assert status == {'autotts': 'verified', 'imo_answerbench': 'verified', 'hmmt24': 'missing', 'hmmt25': 'missing',
                      'hle_math_100': 'verified', 'autotts-reference': 'missing', 'autotts-history': 'missing'}


def test_corrupted_file_is_refused_and_nothing_is_left(data_root, tmp_path, capsys):
    bad = tmp_path / 'mirror'
    [link] = make_mirror(bad, ['imo-answerbench'], data_root)
    body = bytearray(link.read_bytes()); body[1000] ^= 1        # one bit flipped, same size
    link.unlink(); link.write_bytes(bytes(body))
    dest = tmp_path / 'data'
    with Server(bad, tmp_path / 'log') as s:
        assert main(['data', 'fetch', 'imo-answerbench', '--dest', str(dest), '--mirror', s.url, '--retries', '0']) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f'tmas: error: {s.url}/google-deepmind/superhuman/'), err
    assert 'sha256' in lines[0] and 'the file was discarded' in lines[0]
    assert files_under(dest) == []


def test_server_killed_mid_download_then_next_fetch_completes(mirror, tmp_path):
    dest, log = tmp_path / 'data', tmp_path / 'log'
    f = REGISTRY['imo_answerbench'].files[0]
    part = dest / (f.path + '.part')
    with Server(mirror, log, die_after=60_000) as s:
        with pytest.raises(DataFetchError, match='the next run resumes from byte'):
            fetch(['imo-answerbench'], dest, s.url, downloader=Downloader(retries=1, backoff=0.01, progress=False))
        assert s.proc.wait(timeout=10) == -9                    # the server process was killed mid-body
    assert 'KILLED after 60000 bytes' in log.read_text()
    assert not (dest / f.path).exists() and 0 < part.stat().st_size <= 60_000
    got = part.stat().st_size
    with Server(mirror, log, port=s.port) as s2:                # the same address, back up
        assert fetch(['imo-answerbench'], dest, s2.url, downloader=QUIET) == {'imo_answerbench': {f.path: 'downloaded'}}
        assert s2.requests()[-1] == f'GET /google-deepmind/superhuman/{REGISTRY["imo_answerbench"].source.commit}/{f.source_path} bytes={got}-'
    assert sha256_file(dest / f.path) == f.sha256 and not part.exists()


def test_offline_fails_with_one_clear_line(tmp_path, monkeypatch, capsys):
    port = closed_port()
    monkeypatch.setenv('TMAS_DATA_MIRROR', f'http://127.0.0.1:{port}')
    dest = tmp_path / 'data'
    assert main(['data', 'fetch', 'autotts', '--dest', str(dest), '--retries', '1']) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f'tmas: error: cannot download http://127.0.0.1:{port}/zhengkid/AutoTTS/')
    assert 'Connection refused' in lines[0] and '(2 attempts)' in lines[0] and '--mirror' in lines[0]
    assert files_under(dest) == []


def test_local_copies_are_verified(data_root, tmp_path):
    dest = tmp_path / 'data'
    with pytest.raises(ValueError, match=r'`tmas data fetch hmmt25 --from FILE`'): fetch(['hmmt25'], dest)
    assert fetch(['hmmt25'], dest, from_path=data_root / 'benchmarks' / 'hmmt25.jsonl') == {'hmmt25': {'benchmarks/hmmt25.jsonl': 'copied'}}
    with pytest.raises(ChecksumError, match='not the expected file'):
        fetch(['hmmt24'], dest, from_path=data_root / 'benchmarks' / 'hmmt25.jsonl')
    assert files_under(dest) == ['benchmarks/hmmt25.jsonl']
    res = fetch(['autotts-reference', 'hmmt24'], dest, from_path=data_root)
    assert sum(v == 'copied' for v in res['autotts-reference'].values()) == 8 and res['hmmt24'] == {'benchmarks/hmmt24.jsonl': 'copied'}
    assert {r['name']: r['status'] for r in list_datasets(dest)}['autotts-reference'] == 'verified'


def test_fresh_machine_fetch_then_main_job(mirror, data_root, tmp_path, monkeypatch, capsys):
    "No TMAS_DATA_DIR, no ../shared/data, an empty user data folder: fetch the stores, then `tmas replay eval` works."
    env = {k: v for k, v in os.environ.items() if k not in ('TMAS_DATA_DIR', 'TMAS_DATA_HOME', 'TMAS_DATA_MIRROR')}
    env |= {'TMAS_NO_SHARED_DATA': '1', 'XDG_DATA_HOME': str(tmp_path / 'xdg'), 'OMP_NUM_THREADS': '1'}
    for k in ('TMAS_DATA_DIR', 'TMAS_DATA_HOME', 'TMAS_DATA_MIRROR'): monkeypatch.delenv(k, raising=False)
    for k in ('TMAS_NO_SHARED_DATA', 'XDG_DATA_HOME'): monkeypatch.setenv(k, env[k])
    job = ['replay', 'eval', '--model', 'Qwen3-0.6B', '--benchmark', 'aime24', '--controller', 'sc:k=8', '--seeds', '3', '--json']
    assert main(job) == 2
    assert '`tmas data fetch autotts`' in capsys.readouterr().err
    with Server(mirror, tmp_path / 'log') as s:
        r = cli('data', 'fetch', 'autotts', '--mirror', s.url, env=env)
    assert r.returncode == 0, r.stderr
    home = tmp_path / 'xdg' / 'tmas_nb'
    assert f'autotts: 12 files (30.8 MB) verified in {home} (12 downloaded)' in r.stdout
    assert len(files_under(home / 'autotts_replay')) == 12
    r = cli(*job, env=env)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    from tmas_nb.autotts.evaluation import evaluate
    from tmas_nb.autotts.store import load_store
    want = evaluate('sc:k=8', load_store('Qwen3-0.6B', 'aime24', data_root), range(3)).to_dict()
    assert (got['acc'], got['avg_tokens'], got['seeds']) == (want['acc'], want['avg_tokens'], 3)
    assert main(['data', 'list', '--json']) == 0
    rows = {r['name']: r for r in json.loads(capsys.readouterr().out)}
    assert rows['autotts']['status'] == 'verified' and rows['autotts']['data_dir'] == str(home)
    assert rows['imo_answerbench']['licence'] == 'CC-BY 4.0' and 'never redistributed' in rows['autotts']['licence']
    # the data folder exists now; a store missing from it is still reported with the command that provides it
    (home / 'autotts_replay' / 'Qwen3-8B' / 'hmmt25.json').unlink()
    assert main(['replay', 'eval', '--model', 'Qwen3-8B', '--benchmark', 'hmmt25', '--controller', 'sc:k=8']) == 2
    assert 'Get it with `tmas data fetch autotts`' in capsys.readouterr().err


def bare_clone_env(tmp_path, mirror_url: str) -> dict:
    "A user's shell on a bare clone: no TMAS_DATA_DIR, no ../shared/data, an empty user data folder, the mirror to fetch from."
    env = {k: v for k, v in os.environ.items() if k not in ('TMAS_DATA_DIR', 'TMAS_DATA_HOME', 'TMAS_DATA_MIRROR')}
    return env | {'TMAS_NO_SHARED_DATA': '1', 'XDG_DATA_HOME': str(tmp_path / 'xdg'), 'TMAS_DATA_MIRROR': mirror_url, 'OMP_NUM_THREADS': '1'}


def test_main_job_on_a_bare_clone_fetches_the_stores_on_first_use(mirror, data_root, tmp_path, monkeypatch):
    "The README's main command with no data folder configured fetches the 12 pinned stores (here from a mirror on loopback), says so, runs, and the next run fetches nothing."
    from tmas_nb.analysis.reporting import fetch_on_first_use
    home = tmp_path / 'xdg' / 'tmas_nb'
    job = ['report', 'autotts_table', '--quiet', '--out', str(tmp_path / 'out'), '-p', 'models=["Qwen3-4B"]', '-p', 'datasets=["aime24"]',
           '-p', 'seeds=2']                                              # the README's command, at a size for a test
    with Server(mirror, tmp_path / 'log') as s:
        env = bare_clone_env(tmp_path, s.url)
        r = cli(*job, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        ds = REGISTRY['autotts']
        assert (f"report autotts_table: no data folder is configured (TMAS_DATA_DIR is unset), so the AutoTTS replay stores are "
                f"fetched now, once: 12 files, 30.8 MB of {ds.source} from {s.url}, each checked by sha256, into {home}") in r.stderr, r.stderr
        assert f'report autotts_table: 12 stores verified in {home} (12 downloaded)' in r.stderr and len(s.requests()) == 12
        assert all((home / f.path).read_bytes() == (data_root / f.path).read_bytes() for f in ds.files)
        t = (tmp_path / 'out' / 'autotts_table' / 'autotts_table.csv').read_text()
        assert 'Qwen3-4B' in t and 'aime24' in t
        for k in ('TMAS_DATA_DIR', 'TMAS_DATA_HOME'): monkeypatch.delenv(k, raising=False)
        for k in ('TMAS_NO_SHARED_DATA', 'XDG_DATA_HOME', 'TMAS_DATA_MIRROR'): monkeypatch.setenv(k, env[k])
        assert fetch_on_first_use('autotts_table', {}) == {'data_dir': str(home)} and len(s.requests()) == 12   # the next run: found


def test_main_job_on_a_bare_clone_without_a_network_fails_with_one_line(tmp_path):
    "Where the stores cannot be fetched, the main command says what it was doing, then fails in one line that says what to set."
    port = closed_port()
    r = cli('report', 'autotts_table', '--quiet', '--out', str(tmp_path / 'out'), env=bare_clone_env(tmp_path, f'http://127.0.0.1:{port}'))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 2, r.stderr[-3000:]
    assert lines[0].startswith('report autotts_table: no data folder is configured (TMAS_DATA_DIR is unset)'), lines[0]
    assert lines[1].startswith(f'tmas: error: report autotts_table needs the AutoTTS replay stores and could not fetch them '
                               f'(cannot download http://127.0.0.1:{port}/zhengkid/AutoTTS/'), lines[1]
    assert 'Connection refused' in lines[1] and lines[1].endswith('or TMAS_DATA_DIR to a folder that holds them'), lines[1]
    assert files_under(tmp_path / 'xdg' / 'tmas_nb') == [] and not (tmp_path / 'out' / 'autotts_table').exists()


def test_mirror_command_served_by_plain_http_server(data_root, tmp_path, capsys):
    "`tmas data mirror` output served by `python -m http.server` (no Range support) is a working --mirror."
    assert main(['data', 'mirror', str(tmp_path / 'mirror'), 'imo-answerbench', '--data-dir', str(data_root)]) == 0
    assert '1 files laid out' in capsys.readouterr().out
    port = closed_port()
    srv = subprocess.Popen([sys.executable, '-m', 'http.server', str(port), '--bind', '127.0.0.1', '-d', str(tmp_path / 'mirror')],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try: socket.create_connection(('127.0.0.1', port), timeout=0.1).close(); break
            except OSError: time.sleep(0.05)
        f = REGISTRY['imo_answerbench'].files[0]
        part = tmp_path / 'data' / (f.path + '.part'); part.parent.mkdir(parents=True)
        part.write_bytes((data_root / f.path).read_bytes()[:1000])      # a partial file this server cannot resume
        assert fetch(['imo-answerbench'], tmp_path / 'data', f'http://127.0.0.1:{port}', downloader=QUIET) == {'imo_answerbench': {f.path: 'downloaded'}}
        assert sha256_file(tmp_path / 'data' / f.path) == f.sha256 and not part.exists()
    finally:
        srv.kill(); srv.wait()


def test_authors_history_is_pinned_and_fetched_where_from_history_reads_it(tmp_path):
    """The authors' discovery history is an item of its own, outside `all`: 25 files, each at raw.githubusercontent.com
    at the pinned commit with its sha256. Stand-ins of our own (never their contents) served by the loopback mirror at
    the same places, pinned by their own sha256, land where `tmas discover --from-history` reads them; the real pins
    refuse the stand-ins."""
    ds = REGISTRY['autotts-history']
    commit = '6daad631d3a62406910f5e3cf81bc395f8098622'
    assert ds not in resolve_names(['all']) and ds.source.commit == commit and len(ds.files) == 25
    assert all(f.sha256 and len(f.sha256) == 64 and f.size > 1000 for f in ds.files)
    base = f'https://raw.githubusercontent.com/zhengkid/AutoTTS/{commit}/efficient_reasoning_controller/logs/search_history'
    urls = [ds.source.url(f.source_path) for f in ds.files]
    assert all(u.startswith(base + '/r000') for u in urls) and sum(u.endswith('/code_base/method.py') for u in urls) == 5
    assert sum(u.endswith('/proposal_results/matrix_results_Qwen3-4B/aime24_raw_new_api.csv') for u in urls) == 5
    mirror, stand_ins = tmp_path / 'mirror', []
    for f in ds.files:
        body = (b'class OptimalController:\n    pass\n' if f.path.endswith('.py') else
                b'Method,Acc,Cost,Std_Acc,_beta\nOptimalController,50.0,1000,0,0.0\nOptimalController,60.0,3000,0,1.0\n')
        dst = mirror / 'zhengkid' / 'AutoTTS' / commit / f.source_path; dst.parent.mkdir(parents=True, exist_ok=True); dst.write_bytes(body)
        stand_ins.append(replace(f, size=len(body), sha256=hashlib.sha256(body).hexdigest()))
    dest = tmp_path / 'data'
    with Server(mirror, tmp_path / 'log') as s:
        res = fetch(['autotts-history'], dest, s.url, downloader=QUIET, registry={ds.name: replace(ds, files=tuple(stand_ins))})
        assert set(res['autotts-history'].values()) == {'downloaded'} and len(s.requests()) == 25
        assert s.requests()[-1].split()[1] == f'/zhengkid/AutoTTS/{commit}/efficient_reasoning_controller/logs/search_history/r0004/proposal_results/matrix_results_Qwen3-8B/aime24_raw_new_api.csv'
        with pytest.raises(ChecksumError, match='pinned to'):
            fetch(['autotts-history'], tmp_path / 'data2', s.url, downloader=QUIET)
    assert files_under(tmp_path / 'data2') == []
    assert [k for k, _ in history_files(dest / 'autotts_history')] == [0, 1, 2, 3, 4]
    c = history_curves(dest / 'autotts_history')
    assert len(c) == 5 * 4 * 2 and set(c.store) == {f'Qwen3-{m}:aime24' for m in ('0.6B', '1.7B', '4B', '8B')}
