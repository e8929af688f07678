"""The prepared GPU check as the GPU machine will run it. That machine has Python 3.12 with torch, transformers and the
packages of .ci/device-image.txt, and no network; the rest travels as the wheels of .ci/device-wheels.txt.

- The wheels download (once: they are kept in a cache folder outside the repository, TMAS_DEVICE_CACHE, default
  ~/.cache/tmas_nb/device-check, so a fresh clone does not fetch them again) and install for CPython 3.12 on manylinux
  x86-64 into a clean folder with --no-index; every requirement of every wheel is another wheel or on the machine.
- `.ci/device-check` (the one command run there) runs `tmas doctor --device-check --device cpu` through a `python3`
  that behaves as the machine's: the wheels installed as the script installs them, transformers, accelerate and
  huggingface-hub at the machine's versions (the pure-Python `# twin` lines of .ci/device-image.txt), and no other
  package of this environment importable (tests/device_twin.py). The whole check must pass at its tiny sizes.

Downloading into a cache rather than the repository's .whl keeps CI from fetching on every run and leaves .whl to the
developer; the twin is a folder of the three pure-Python packages, so torch and numpy stay this environment's."""
import json, os, re, subprocess, sys, tempfile
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get('TMAS_DEVICE_CACHE') or Path.home() / '.cache' / 'tmas_nb' / 'device-check')
IMAGE, WHEELS = ROOT / '.ci' / 'device-image.txt', ROOT / '.ci' / 'device-wheels.txt'
TARGET = ['--python-version', '3.12', '--implementation', 'cp', '--only-binary=:all:', '--platform', 'manylinux_2_28_x86_64',
          '--platform', 'manylinux_2_17_x86_64', '--platform', 'manylinux2014_x86_64']
DEVICE_ENV = {**default_environment(), 'python_version': '3.12', 'python_full_version': '3.12.3', 'sys_platform': 'linux',
              'platform_system': 'Linux', 'platform_machine': 'x86_64', 'implementation_name': 'cpython', 'extra': ''}


def pins(path) -> dict:
    "name -> version (None when not given) of a list file: one package a line, `# comments` allowed."
    out = {}
    for line in Path(path).read_text().splitlines():
        line = line.split('#', 1)[0].strip()
        if line:
            name, _, ver = line.partition('==')
            out[canonicalize_name(name)] = ver.strip() or None
    return out


def twin_pins() -> dict:
    return {canonicalize_name(l.split('==')[0]): l.split('==')[1].split()[0]
            for l in IMAGE.read_text().splitlines() if l.rstrip().endswith('# twin')}


def run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert p.returncode == 0, f"{cmd[:4]}... exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p


@pytest.fixture(scope='module')
def wheels():
    "The folder of the device wheels, filled by .ci/device-wheels (downloads only what is missing)."
    d = CACHE / 'wheels'
    run(['bash', str(ROOT / '.ci' / 'device-wheels'), str(d)], env={**os.environ, 'PYTHON': sys.executable})
    return d


@pytest.fixture(scope='module')
def twin(tmp_path_factory):
    "A folder holding the machine's versions of the `# twin` packages (installed once into the cache)."
    want = twin_pins()
    site = CACHE / ('twin-' + '-'.join(f'{n}{v}' for n, v in sorted(want.items())))
    if not (site / '.complete').exists():
        dl = CACHE / 'twin-wheels'
        run([sys.executable, '-m', 'pip', 'download', '-q', '--no-deps', '--only-binary=:all:', '--retries', '5', '-d', str(dl),
             *[f'{n}=={v}' for n, v in want.items()]])
        files = [f for f in dl.glob('*.whl') if canonicalize_name(parse_wheel_filename(f.name)[0]) in want
                 and str(parse_wheel_filename(f.name)[1]) == want[canonicalize_name(parse_wheel_filename(f.name)[0])]]
        run([sys.executable, '-m', 'pip', 'install', '-q', '--no-index', '--no-deps', '--upgrade', '--target', str(site), *map(str, files)])
        (site / '.complete').write_text('\n'.join(sorted(f.name for f in files)))
    return site


def test_the_wheels_install_into_a_clean_target_without_an_index(wheels, tmp_path):
    listed, image = pins(WHEELS), pins(IMAGE)
    files = sorted(wheels.glob('*.whl'))
    got = {canonicalize_name(parse_wheel_filename(f.name)[0]): str(parse_wheel_filename(f.name)[1]) for f in files}
    assert len(files) == len(got) == len(listed) and got == listed, f"{wheels} holds {got}, the list says {listed}"
    assert not set(listed) & set(image), f"packages both on the machine and in the wheel list: {set(listed) & set(image)}"
    size = sum(f.stat().st_size for f in files)
    assert size < 40 * 2 ** 20, f"the wheels take {size / 2 ** 20:.1f} MiB"
    site = tmp_path / 'site'
    run([sys.executable, '-m', 'pip', 'install', '-q', '--no-index', '--no-deps', '--target', str(site), *TARGET, *map(str, files)])
    installed = {}
    for d in site.glob('*.dist-info'):
        meta = (d / 'METADATA').read_text(encoding='utf-8')
        name = canonicalize_name(re.search(r'^Name: (.+)$', meta, re.M).group(1).strip())
        installed[name] = re.search(r'^Version: (.+)$', meta, re.M).group(1).strip()
        for line in re.findall(r'^Requires-Dist: (.+)$', meta, re.M):
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(DEVICE_ENV): continue
            dep = canonicalize_name(req.name)
            assert dep in listed or dep in image, f"{name} needs {req}: neither a wheel of {WHEELS.name} nor on the machine ({IMAGE.name})"
            have = listed[dep] if dep in listed else image[dep]          # None: on the machine, version not recorded
            if have: assert req.specifier.contains(Version(have), prereleases=True), f"{name} needs {req}; the machine would have {dep} {have}"
    assert installed == listed


def twin_python(tmp_path) -> Path:
    "A `python3` that behaves as the GPU machine's: pip installs for it, and modules run through tests/device_twin.py."
    bin_ = tmp_path / 'bin'; bin_.mkdir()
    py, twin = sys.executable, ROOT / 'tests' / 'device_twin.py'
    (bin_ / 'python3').write_text(
        '#!/usr/bin/env bash\n'
        f'if [ "$1 $2 $3" = "-m pip install" ]; then shift 3; exec "{py}" -m pip install {" ".join(TARGET)} "$@"; fi\n'
        f'if [ "$1" = "-m" ] || [ "$1" = "-c" ]; then exec "{py}" "{twin}" "{IMAGE}" "$@"; fi\n'
        f'exec "{py}" "$@"\n')
    (bin_ / 'python3').chmod(0o755)
    return bin_


def test_the_twin_has_what_the_machine_has_and_nothing_else(wheels, twin, tmp_path):
    "The stand-in is no stand-in if it sees this environment: a package the machine lacks must be missing there."
    site = tmp_path / 'site'
    run([sys.executable, '-m', 'pip', 'install', '-q', '--no-index', '--no-deps', '--target', str(site), *TARGET, *map(str, wheels.glob('*.whl'))])
    code = ("import importlib.util as u, importlib.metadata as md\n"
            "print(md.version('transformers'), md.version('accelerate'), md.version('huggingface-hub'), md.version('trl'))\n"
            "print([m for m in ('fastapi', 'gguf', 'openai', 'papermill', 'nbdev', 'kernels') if u.find_spec(m) is not None])\n"
            "print(u.find_spec('trl').origin.startswith(" + repr(str(site)) + "), u.find_spec('torch') is not None)\n")
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(site), str(ROOT), str(twin)])}
    out = run([str(twin_python(tmp_path) / 'python3'), '-c', code], env=env).stdout.split('\n')
    t = twin_pins()
    assert out[0].split() == [t['transformers'], t['accelerate'], t['huggingface-hub'], pins(WHEELS)['trl']]
    assert out[1:3] == ['[]', 'True True']


def test_device_check_runs_as_on_the_gpu_machine(wheels, twin, tmp_path):
    bin_, out = twin_python(tmp_path), tmp_path / 'out'
    env = {**os.environ, 'PATH': f"{bin_}{os.pathsep}{os.environ['PATH']}", 'PYTHONPATH': str(twin), 'TMAS_DEVICE_WHEELS': str(wheels),
           'TMAS_DEVICE_SITE': str(tmp_path / 'site'), 'OMP_WAIT_POLICY': 'PASSIVE', 'TMAS_TWIN_LOG': str(tmp_path / 'absent.txt')}
    p = subprocess.run(['bash', str(ROOT / '.ci' / 'device-check'), '--device', 'cpu', '--out', str(out)], capture_output=True,
                       text=True, env=env, timeout=600, cwd=tmp_path)
    absent = sorted(set((tmp_path / 'absent.txt').read_text().split())) if (tmp_path / 'absent.txt').exists() else []
    assert p.returncode == 0, f"exit {p.returncode}; modules absent there: {absent}\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}"
    r = json.loads((out / 'device_check.json').read_text())
    t = twin_pins()
    assert (r['ok'], r['run_on'], r['sizes']['tiny']) == (True, 'cpu', True)
    assert (r['versions']['transformers'], r['versions']['accelerate'], r['versions']['trl']) == (t['transformers'], t['accelerate'], pins(WHEELS)['trl'])
    assert [r[k]['ok'] for k in ('parity', 'speed', 'grpo')] == [True, True, True]
    assert r['parity']['greedy']['device_vs_cpu'] is None and r['parity']['float32']['max_rel'] <= 1e-3
    assert set(r['speed']['engines']) == {'ours', 'generate'} and r['speed']['probe_path']['branches_equal'] == r['speed']['probe_path']['branches']
    assert r['grpo']['steps'] == 1 and r['grpo']['largest_weight_change'] > 0
    table = (out / 'device_check.md').read_text()
    assert table in p.stdout and table.count('| ok |') >= 9 and 'FAILED' not in table
