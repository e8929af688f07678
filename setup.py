"""Package metadata, read from settings.ini (the project's one dependency list)."""
from configparser import ConfigParser
from pathlib import Path

import setuptools

here = Path(__file__).parent
config = ConfigParser(delimiters=['='])
config.read(here / 'settings.ini', encoding='utf-8')
cfg = config['DEFAULT']

licenses = {'apache2': 'Apache-2.0'}   # settings.ini's licence (nbdev's name) as an SPDX expression (PEP 639)
statuses = ['1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable']

requirements = cfg.get('requirements', '').split()
dev_requirements = cfg.get('dev_requirements', '').split()
console_scripts = cfg.get('console_scripts', '').split()

setuptools.setup(
    name=cfg['lib_name'],
    version=cfg['version'],
    description=cfg['description'],
    long_description=(here / 'README.md').read_text(encoding='utf-8'),
    long_description_content_type='text/markdown',
    author=cfg['author'],
    author_email=cfg['author_email'],
    url=cfg['git_url'],
    license_expression=licenses[cfg['license']],   # no licence classifier: setuptools >= 77 refuses both together
    keywords=cfg['keywords'],
    classifiers=[
        'Development Status :: ' + statuses[int(cfg['status'])],
        'Intended Audience :: ' + cfg['audience'],
        'Natural Language :: ' + cfg['language'],
        'Programming Language :: Python :: 3',
    ],
    python_requires='>=' + cfg['min_python'],
    packages=setuptools.find_packages(include=[cfg['lib_name'], cfg['lib_name'] + '.*']),
    include_package_data=True,
    # the example controller files are data read by tmas_nb.autotts.authors_api.example_controller
    package_data={cfg['lib_name'] + '.autotts': ['examples/*.py']},
    install_requires=requirements,
    extras_require={'dev': dev_requirements},
    entry_points={
        'console_scripts': console_scripts,
        'nbdev': [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"],
    },
    zip_safe=False,
)
