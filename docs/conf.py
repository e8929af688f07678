"""Sphinx settings of the documentation site; `python .ci/docs.py` builds it (read that file first).

The site's address, title and description come from settings.ini (doc_host + doc_baseurl, title, description), so
the site, the package and the README cannot disagree about them."""
import configparser
from pathlib import Path

_ini = configparser.ConfigParser()
_ini.read(Path(__file__).resolve().parent.parent / 'settings.ini', encoding='utf-8')
_s = _ini['DEFAULT']

project = _s['title']
author = _s['author']
copyright = _s['copyright']
release = version = _s['version']
site_url = html_baseurl = _s['doc_host'].rstrip('/') + '/' + _s['doc_baseurl'].strip('/') + '/'

extensions = ['myst_nb']
root_doc = 'index'
exclude_patterns = ['_build', '**/.ipynb_checkpoints']
source_suffix = {'.ipynb': 'myst-nb', '.md': 'myst-nb'}

nb_execution_mode = 'off'            # the notebooks are shown with the outputs they were committed with
nb_output_stderr = 'remove'          # progress bars and warnings, as in the README
nb_merge_streams = True
myst_heading_anchors = 3             # [text](page.ipynb#a-heading) links resolve
myst_enable_extensions = ['colon_fence']
suppress_warnings = ['myst.header']  # the API reference sits under a notebook's own headings, whatever their level

html_theme = 'furo'
html_title = f"{_s['title']}"
html_short_title = _s['title']
html_copy_source = False
html_show_sourcelink = False
html_theme_options = {'navigation_with_keys': True}   # no view/edit buttons: furo would point them at nbs/ for every page
                                                     # (reports/ too); each API entry links its own source instead
pygments_style = 'friendly'
