"""gradpress's logger: ``logging.getLogger("gradpress")``.

The library logs through this one logger and configures nothing: as the ``logging`` documentation asks of
libraries, it only adds a ``NullHandler``, so that nothing is printed unless the application configures
logging (``logging.basicConfig(level=logging.INFO)`` shows gradpress's INFO lines, e.g. what was compiled
before training and how long it took). Guidelines for the library's own lines:

* one line per event a user can act on or would wonder about (a compilation of some seconds, a fallback
  taken), never one per step or per tensor;
* ``INFO`` for what setting up does that takes time, ``WARNING`` for something that works but not as
  asked, ``DEBUG`` for details; errors are raised, not logged;
* ``%``-style arguments (``logger.info("compiled %d kernels", n)``), so that a line not shown costs no
  formatting;
* modules use ``from gradpress.log import logger`` rather than loggers of their own, so that one name
  (``"gradpress"``) configures them all.
"""
from __future__ import annotations

import logging

logger = logging.getLogger("gradpress")
logger.addHandler(logging.NullHandler())
