from dataclasses import dataclass
from tmas_nb.autotts.controllers import CMC

@dataclass
class MyCMC(CMC):
    "The built-in CMC, subclassed: a file may import the library's helpers."
    name = 'my_cmc'
