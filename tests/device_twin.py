"""Run a module as on the GPU machine: of this environment's installed packages only those of .ci/device-image.txt can be
imported (or found by importlib.metadata); the folders on PYTHONPATH (the wheels of .ci/device-wheels.txt installed
with --target, the twin versions, the repository) come first as they would there. Anything else is absent, exactly as a
missing package is: `import` fails and `importlib.util.find_spec` returns None.

    python tests/device_twin.py .ci/device-image.txt -m MODULE [ARGS...]   (as `python -m MODULE ARGS...`)
    python tests/device_twin.py .ci/device-image.txt -c CODE               (as `python -c CODE`)

TMAS_TWIN_LOG=FILE appends each absent module asked for to FILE."""
import importlib.abc, importlib.machinery, importlib.metadata as md, os, re, runpy, site, sys
from pathlib import Path


def _norm(name: str) -> str: return re.sub(r'[-_.]+', '-', name).lower()


def image_names(path) -> set[str]:
    "Normalised distribution names listed in an image file (one per line, `==version` and `# comments` allowed)."
    out = set()
    for line in Path(path).read_text().splitlines():
        line = line.split('#', 1)[0].strip()
        if line: out.add(_norm(re.split(r'[=<>!~ ;\[]', line, maxsplit=1)[0]))
    return out


def top_level_names(dist) -> set[str]:
    "The top-level modules a distribution installs."
    txt = dist.read_text('top_level.txt')
    if txt: return {t.strip() for t in txt.split() if t.strip()}
    tops = set()
    for f in dist.files or []:
        head = f.parts[0] if f.parts else ''
        if not head or head.endswith(('.dist-info', '.egg-info', '.pth')) or head in ('..', '__pycache__', 'bin'): continue
        tops.add(head[:-3] if head.endswith('.py') else head.split('.')[0])
    return tops


class DeviceImage(importlib.abc.MetaPathFinder):
    "Finds modules and distributions in `sites` only when their distribution is one of `allowed`."
    def __init__(self, sites: list[str], allowed: set[str], log: str | None = None):
        self.sites, self.allowed, self.log = sites, allowed, log
        self.tops = set()
        for d in md.distributions(path=sites):
            if _norm(d.metadata['Name'] or '') in allowed: self.tops |= top_level_names(d)

    def find_spec(self, name, path=None, target=None):
        if path is not None: return None                  # a submodule: its package's own path finds it
        if name in self.tops: return importlib.machinery.PathFinder.find_spec(name, self.sites)
        if self.log and importlib.machinery.PathFinder.find_spec(name, self.sites) is not None:
            with open(self.log, 'a') as f: f.write(name + '\n')
        return None

    def find_distributions(self, context=md.DistributionFinder.Context()):
        ctx = md.DistributionFinder.Context(name=context.name, path=self.sites)
        for d in md.MetadataPathFinder.find_distributions(ctx):
            if _norm(d.metadata['Name'] or '') in self.allowed: yield d


def main():
    image, how, what, *args = sys.argv[1:]
    if how not in ('-m', '-c'): raise SystemExit(f"device_twin: expected -m MODULE or -c CODE, got {how!r}")
    sites = [p for p in site.getsitepackages() + [site.getusersitepackages()] if p in sys.path]
    sys.path[:] = [p for p in sys.path if p not in sites]
    sys.meta_path.append(DeviceImage(sites, image_names(image), os.environ.get('TMAS_TWIN_LOG')))
    if how == '-c':
        sys.argv = ['-c', *args]
        exec(compile(what, '<string>', 'exec'), {'__name__': '__main__'})
    else:
        sys.argv = [what, *args]
        runpy.run_module(what, run_name='__main__', alter_sys=True)


if __name__ == '__main__': main()
