"""One name per idea across every `tmas` subcommand.

FLAGS is the table of allowed names: each visible flag with its one meaning and the commands that may use it. The test
walks every subcommand's parser and fails when a flag is missing from the table (decide whether it is a new idea or an
existing one under another name), when a command uses a flag the table does not give it (a second meaning?), when one
flag stores into two destinations, or when an old spelling is visible instead of hidden."""
import argparse
import contextlib
import io

import pytest

from tmas_nb.cli import COMMANDS, build_parser

MODEL_CMDS = {'data hard-subset', 'doctor', 'engines calibrate', 'engines show', 'replay build', 'replay eval', 'replay show', 'rl teacher',
              'rl train', 'run', 'serve'}
FLAGS = {
    # the model, and where it runs (tmas_nb.settings.ModelSettings)
    '--model': ('the model: a packaged name, a folder, or the served name with --base-url (replay: whose traces)', MODEL_CMDS),
    '--backend': ('where the model runs: auto, transformers, llama.cpp or openai', {'rl teacher', 'run', 'serve'}),
    '--base-url': ('URL of an OpenAI-compatible server that answers the model calls', {'discover', 'replay build', 'rl teacher', 'run'}),
    '--api-key': ('the API key of that server (for serve and gateway: the key it requires)', {'discover', 'replay build', 'run', 'serve', 'gateway'}),
    '--served-model': ("the model's name on the server", {'data hard-subset', 'judge', 'serve'}),
    '--threads': ('CPU threads of a model run here', {'data hard-subset', 'discover', 'engines calibrate', 'engines show',
                                                      'judge', 'replay build', 'rl teacher', 'rl train', 'run', 'serve', 'gateway'}),
    '--device': ("'cpu' or 'cuda'", {'doctor', 'serve'}),
    '--dtype': ('weight dtype', {'serve'}),
    '--quantize': ('int8 linear layers on a CPU', {'run', 'serve'}),
    '--llama-slots': ('llama.cpp slots', {'run'}),
    '--max-n-per-call': ('most samples asked of a server in one call', {'run'}),
    '--requests-in-flight': ('most HTTP requests in flight to --base-url', {'replay build', 'run'}),
    '--progress-every': ('seconds between two progress lines when stderr is a log', {'run', 'gateway'}),
    '--decode': ('the in-process decode loop', {'doctor'}),
    '--engines': ('a subset of the CPU engines', {'engines calibrate'}),
    '--tokenizer': ("the served model's tokenizer", {'replay build'}),
    '--chunked': ('with --base-url: one request per probe interval, as a live controller run through a server decodes', {'replay build'}),
    '--proposer': ('the model that writes controllers', {'discover'}),
    '--critic': ('the model that reviews them', {'discover'}),
    '--judge': ('the judge model (a name, a folder or a server URL)', {'data hard-subset', 'judge', 'rl train'}),
    # sampling (tmas_nb.methods.agents.SamplingConfig)
    '--temperature': ('sampling temperature', {'data hard-subset', 'judge', 'replay build', 'run'}),
    '--top-p': ('nucleus mass', {'data hard-subset', 'replay build', 'run'}),
    '--top-k': ('top-k', {'data hard-subset', 'run'}),
    '--max-new-tokens': ('new tokens per model answer', {'data hard-subset', 'discover', 'doctor', 'engines calibrate', 'judge',
                                                        'replay build', 'rl teacher', 'run'}),
    '--seed': ('the one seed every random choice derives from', {'data hard-subset', 'discover', 'judge', 'replay build',
                                                                  'replay show', 'rl data', 'rl teacher', 'rl train', 'run'}),
    # the sandbox (tmas_nb.settings.SandboxSettings)
    '--api': ("a controller file's API", {'replay eval', 'replay grid', 'replay show'}),
    '--timeout': ('seconds allowed for one unit of work (an evaluation, a comparison, a download without data)',
                  {'data fetch', 'discover', 'grade', 'replay eval', 'replay grid', 'replay show'}),
    '--memory-mb': ('memory budget of the sandbox', {'discover', 'replay eval', 'replay grid', 'replay show'}),
    '--jobs': ('parallel workers', {'discover', 'engines build-llama', 'replay eval', 'replay grid'}),
    '--stateless': ('an authors\'-API class keeps no state between questions', {'discover', 'replay eval', 'replay grid'}),
    '--no-sandbox': ('run without the sandbox (trusted code only)', {'discover', 'replay eval', 'replay grid', 'replay show'}),
    # output (tmas_nb.settings.OutputSettings)
    '--out': ('where the results go: a folder or a file', {'data hard-subset', 'discover', 'doctor', 'replay build', 'replay grid',
                                                          'report', 'rl data', 'rl teacher', 'rl train', 'run', 'gateway'}),
    '--quiet': ('no progress bar', {'data fetch', 'data hard-subset', 'discover', 'engines build-llama', 'engines calibrate',
                                    'judge', 'replay build', 'replay eval', 'replay grid', 'report', 'rl teacher', 'rl train', 'run'}),
    '--device-check': ('the prepared GPU check instead of the usual one', {'doctor'}),
    '--json': ('print one JSON object', {'compare', 'data list', 'doctor', 'grade', 'replay eval', 'runs summary'}),
    '--html': ('write an HTML file', {'runs export'}),
    # data
    '--data-dir': ('the data folder', {'data list', 'data mirror', 'discover', 'replay build', 'replay eval', 'replay grid', 'replay show'}),
    '--benchmark': ('a benchmark: a name or a file (replay: the store of that benchmark)',
                    {'data hard-subset', 'judge', 'replay build', 'replay eval', 'replay show', 'run', 'gateway'}),
    '--problems': ('the training problems of `rl teacher`: a benchmark name or a problem file with gold answers', {'rl teacher'}),
    '--benchmarks': ('benchmarks, comma-separated', {'replay grid'}),
    '--models': ('models, comma-separated', {'replay grid'}),
    '--limit': ('only the first K problems', {'data hard-subset', 'replay build', 'rl teacher', 'run'}),
    '--problem-ids': ('a file of problem ids', {'run'}),
    '--dest': ('the data folder to fill', {'data fetch'}),
    '--mirror': ('a data mirror', {'data fetch'}),
    '--from': ('a local copy of the files', {'data fetch'}),
    '--retries': ('further download attempts', {'data fetch'}),
    '--copy': ('copy instead of linking', {'data mirror'}),
    # methods and runs
    '--method': ('the method', {'run'}), '--preset': ("a paper's settings", {'discover', 'run', 'gateway'}),
    '--rse-sampling': ("RSE's sampling under tmas-paper: its own row or TMAS's", {'run'}),
    '--print-config': ('print the resolved configuration and exit', {'run'}),
    '--yes': ('start a run on this CPU whose estimate exceeds an hour', {'run'}),
    '--role-endpoint': ("one agent role's own server and model", {'run', 'gateway'}),
    '--config': ('a JSON file of settings (or a preset name)', {'rl train', 'run'}),
    '--n-candidates': ('N', {'rl teacher', 'run'}), '--n-verifications': ('M', {'rl teacher', 'run'}),
    '--iterations': ('T', {'rl teacher', 'run'}),
    '--epsilon': ('exploration probability', {'run'}), '--concurrency': ('problems run at the same time', {'run', 'gateway'}),
    '--answer-from-truncated': ("grade a cut-off output's last box, or as RSE's release reads it", {'grade', 'run'}),
    '--templates': ("a JSON file of prompt templates replacing the package's", {'run'}),
    # reading a run
    '--problem': ('one problem of a run, by its id', {'runs show'}),
    '--iteration': ('one iteration of a run (0 is the first, as in records.parquet)', {'runs show'}),
    '--role': ('one agent role (solution, verification, summary, experience, guideline, distillation, refine)', {'runs show'}),
    '--full': ('texts in full, not shortened', {'runs show'}),
    # replay
    '--controller': ('a controller spec (run, replay show: or a controller file; run: or discovery:DIR)', {'replay eval', 'replay show', 'run'}), '--controllers': ('controller specs', {'replay grid'}),
    '--controller-file': ('a controller file', {'replay eval', 'replay grid'}),
    '--controller-class': ('its class', {'replay eval', 'replay grid', 'replay show', 'run'}),
    '--controller-config': ("its class's parameters", {'replay eval', 'replay show', 'run'}),
    '--controller-configs': ("its class's parameter sets", {'replay grid'}),
    '--max-branches': ('the ceiling on branches per episode', {'replay eval', 'replay grid', 'discover'}),
    '--seeds': ('number of seeds (branch orders)', {'discover', 'replay eval', 'replay grid'}),
    '--trace': ('a step trace file', {'replay eval'}), '--trace-seeds': ('seeds traced', {'replay eval'}),
    '--question': ('one question of the store, 0-based', {'replay show'}), '--png': ('the PNG file a picture goes to', {'compare', 'replay show'}),
    '--branches': ('branches per question', {'replay build', 'run'}), '--probe-every': ('probe interval', {'replay build', 'run'}),
    '--probe-tokens': ('tokens per probe', {'replay build', 'run'}),
    '--rounds': ('discovery rounds', {'discover'}), '--train': ('search stores', {'discover'}),
    '--heldout': ('held-out stores', {'discover'}),
    '--agent-cmd': ("a coding agent's command line, run each round in the workspace", {'discover'}),
    '--agent-mount': ('an extra read-only path for the agent', {'discover'}),
    '--agent-timeout': ('wall-clock seconds of one agent run', {'discover'}),
    '--agent-allow': ('a service on this machine the agent may reach', {'discover'}),
    '--agent-disk-mb': ("size of the agent's workspace", {'discover'}),
    '--select': ('the selection rule of a discovery run', {'discover'}),
    '--reference': ('a reference curve shown to the proposer', {'discover'}),
    '--no-traces': ('no execution traces recorded or shown', {'discover'}),
    '--free-params': ('no β contract: the file lists its own settings', {'discover'}),
    '--turns': ('drafts of the built-in proposer per round', {'discover'}),
    '--code-rounds': ('earlier rounds whose full code the prompt holds', {'discover'}),
    '--context': ("the proposer's context in tokens", {'discover'}),
    '--price-in': ('dollars per million input tokens', {'discover'}),
    '--price-out': ('dollars per million output tokens', {'discover'}),
    '--from-history': ('a finished discovery history to re-score', {'discover'}),
    # grading and judging
    '--gold': ('the reference answer', {'grade'}), '--pred': ('the prediction', {'grade'}),
    '--finish-reason': ('why the output ended', {'grade'}),
    '--repeats': ('judgements per candidate', {'judge'}), '--scope': ('which candidates', {'judge'}),
    '--samples': ('samples per problem', {'data hard-subset'}), '--threshold': ('correct-sample threshold', {'data hard-subset'}),
    '--k': ('problems to pick', {'data hard-subset'}),
    '--allow-cut': ('write the subset although more than 5 % of the samples were cut', {'data hard-subset'}),
    '--rules': ('grade with the rule-based answer check instead of the judge', {'data hard-subset'}),
    # serving
    '--upstream': ('the model server (or in-process model) a gateway sends its inner calls to', {'gateway'}),
    '--upstream-model': ("the model's name on --upstream", {'gateway'}),
    '--upstream-api-key': ('the API key of --upstream', {'gateway'}),
    '--max-total-tokens': ('most new tokens the inner calls of one request may generate', {'gateway'}),
    '--max-request-samples': ('most samples the inner calls of one request may ask for', {'gateway'}),
    '--expose-grades': ("answers say whether a question of the gateway's benchmark was answered correctly", {'gateway'}),
    '--allow-templates': ('requests may replace the prompt templates', {'gateway'}),
    '--host': ('listen address', {'serve', 'gateway'}), '--port': ('listen port', {'serve', 'gateway'}),
    '--max-batch-size': ('sequences decoded together', {'serve'}), '--max-n': ('most samples per request', {'serve'}),
    '--max-tokens': ('most new tokens per request', {'serve'}),
    '--default-max-tokens': ('max_tokens of a request that gives none', {'serve'}),
    '--max-model-len': ('the context a server serves (prompt + new tokens), at most the model\'s', {'serve'}),
    '--max-body-mb': ('largest request body', {'serve', 'gateway'}), '--max-queue': ('requests queued at once', {'serve', 'gateway'}),
    '--shutdown-timeout': ('grace period on SIGTERM', {'serve', 'gateway'}),
    '--max-messages': ('most chat messages per request', {'serve', 'gateway'}),
    '--max-message-chars': ('most characters per chat message', {'serve', 'gateway'}),
    '--max-connections': ('most open connections', {'serve', 'gateway'}),
    '--header-timeout': ('seconds for a request line and headers', {'serve', 'gateway'}),
    '--body-timeout': ('seconds for a request body', {'serve', 'gateway'}),
    '--keep-alive': ('seconds an idle connection stays open', {'serve', 'gateway'}),
    '--allow-unauthenticated': ('no key beyond loopback', {'serve', 'gateway'}), '--log-level': ('uvicorn log level', {'serve', 'gateway'}),
    # engines, reports, RL
    '--widths': ('widths to measure', {'engines calibrate'}), '--width': ('a width to show', {'engines show'}),
    '--batch': ('requests in the throughput batch', {'doctor'}), '--version': ('llama-cpp-python release', {'engines build-llama'}),
    '-p': ('a report parameter', {'report'}), '--param': ('a report parameter', {'report'}),
    '--runs': ('run folders (rl data); K independent runs, seeds into OUT/run-k (run)', {'rl data', 'run'}), '--objective': ('what the rows train', {'rl data'}),
    '--toy-problems': ('problems of the toy task', {'rl data', 'rl train'}), '--task': ('the training rows', {'rl train'}),
    '--reward': ('the reward', {'rl train'}), '--max-steps': ('optimiser steps', {'rl train'}),
    '--num-generations': ('G', {'rl train'}), '--max-completion-length': ('tokens per rollout', {'rl train'}),
    '--save-steps': ('checkpoint interval', {'rl train'}), '--learning-rate': ('learning rate', {'rl train'}),
    '--objectives': ("the toy task's objectives", {'rl train'}), '--novelty': ("how a rollout's novelty is read", {'rl train'}),
    '--problems-per-step': ('groups per optimiser step', {'rl train'}), '--dry-run': ('print what the command would do (rl train: the settings; run: the calls, tokens, wall time and engine), do nothing', {'rl train', 'run'}),
    '--every': ('seconds between two prints', {'runs watch'}), '--once': ('print once and exit', {'runs watch'}),
    '--mix': ('proportions of the objectives', {'rl data', 'rl teacher'}), '--format': ('file layout: tmas or verl', {'rl data', 'rl teacher'}),
}

# old spellings: (command, old flag, a value or None for a switch, destination, the new flag)
RENAMED = [
    ('serve', '--served-model-name', 'm', 'served_model', '--served-model'),
    ('serve', '--num-threads', '2', 'threads', '--threads'),
    ('serve', '--engine', 'llama.cpp', 'backend', '--backend'),
    ('serve', '--max-tokens-limit', '64', 'max_tokens', '--max-tokens'),
    ('replay eval', '--dataset', 'aime24', 'benchmark', '--benchmark'),
    ('replay grid', '--datasets', 'aime24', 'benchmarks', '--benchmarks'),
    ('judge', '--runs', '3', 'repeats', '--repeats'),
    ('doctor', '--engine', 'batched', 'decode', '--decode'),
    ('data fetch', '--base-url', 'http://127.0.0.1:1', 'mirror', '--mirror'),
    ('replay build', '--concurrency', '4', 'requests_in_flight', '--requests-in-flight'),
]
REQUIRED = {'replay eval': ['--model', 'Qwen3-4B', '--benchmark', 'aime24', '--controller', 'sc:k=4'],
            'replay grid': ['--out', 'g.csv'], 'judge': ['RUN', '--judge', 'smollm2'], 'data fetch': ['autotts'],
            'replay build': ['--model', 'default', '--benchmark', 'demo', '--out', 's.json', '--branches', '2',
                             '--probe-every', '8', '--max-new-tokens', '16']}


def leaves():
    "(command, parser) for every subcommand."
    out = []
    def walk(p, path):
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if subs:
            for name, sp in subs[0].choices.items(): walk(sp, path + [name])
        else: out.append((' '.join(path), p))
    walk(build_parser(), [])
    return out


def visible(p):
    "(flag, dest) of every flag shown in `p`'s help."
    for a in p._actions:
        if not a.option_strings or a.help == argparse.SUPPRESS or a.dest == 'help': continue
        for s in a.option_strings:
            if s not in getattr(a, 'old', ()): yield s, a.dest


def test_every_command_in_the_table_is_a_subcommand():
    assert sorted(c for c, _ in leaves()) == sorted(COMMANDS)


def test_every_flag_has_one_name_and_one_meaning():
    unknown, misplaced, dests = [], [], {}
    for cmd, p in leaves():
        for flag, dest in visible(p):
            if flag not in FLAGS: unknown.append(f"{cmd} {flag}"); continue
            if cmd not in FLAGS[flag][1]: misplaced.append(f"{cmd} {flag} (the table gives it to {sorted(FLAGS[flag][1])})")
            dests.setdefault(flag, set()).add(dest)
    assert not unknown, f"flags not in the table (a new idea, or an existing one under another name?): {unknown}"
    assert not misplaced, f"flags used where the table does not allow them (a second meaning?): {misplaced}"
    two = {f: d for f, d in dests.items() if len(d) > 1}
    assert not two, f"one flag, several destinations: {two}"
    by_dest = {}
    for f, ds in dests.items():
        for d in ds: by_dest.setdefault(d, set()).add(f)
    short = {'param'}                                      # -p / --param are one flag
    several = {d: fs for d, fs in by_dest.items() if len(fs) > 1 and d not in short}
    assert not several, f"one setting under several flags: {several}"


def test_the_table_names_no_flag_that_is_gone():
    used = {f for _, p in leaves() for f, _ in visible(p)}
    assert set(FLAGS) - used == set()


@pytest.mark.parametrize('cmd,old,value,dest,new', RENAMED)
def test_old_spellings_are_hidden_aliases(cmd, old, value, dest, new):
    parser = build_parser()
    leaf = dict(leaves())[cmd]
    assert old not in leaf.format_help() and new in leaf.format_help()
    argv = [*cmd.split(), *REQUIRED.get(cmd, []), old, *([value] if value is not None else [])]
    err = io.StringIO()
    with contextlib.redirect_stderr(err): args = parser.parse_args(argv)
    assert str(getattr(args, dest)) == value
    assert err.getvalue().strip() == f"tmas: warning: {old} is deprecated; use {new}"


def test_long_work_can_be_quiet():
    quiet = FLAGS['--quiet'][1]
    for cmd, p in leaves():
        if cmd in quiet: assert '--quiet' in dict(visible(p)), cmd
