"""``localchat bench``: speed and memory figures against their targets, one module a part.

- ``run``: the registry (part name -> function), the targets, the run and its report
- ``common``: progress lines, scratch folders, the cold greedy turn, filler text, the
  2,000-token conversation
- ``rss``: one full-context turn measured in a fresh process (its own peak: ``VmHWM``)
- ``engine``, ``resume``, ``window``, ``estimate``, ``ui``, ``plan``, ``memory``, ``remote``,
  ``zerowait``, ``branch``, ``calibrate``: the parts, as ``--only`` names them
"""
