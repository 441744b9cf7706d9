"""kvroute as a Gateway API Inference Extension endpoint picker (EPP).

Envoy asks, over its external processing API, where each inference request goes; the EPP
answers with the worker the router's own decision picks (:mod:`router.epp.picker`), in the
protocol's header and metadata (:mod:`router.epp.messages`), one request at a time
(:mod:`router.epp.exchange`), served by :mod:`router.epp.server`.
"""

from router.epp.exchange import Exchange, kind_for_path
from router.epp.messages import DESTINATION_HEADER, PREFILLER_HEADER
from router.epp.picker import Pick, Picker, endpoint_of
from router.epp.server import ExternalProcessor, epp_server, run_epp

__all__ = [
    "DESTINATION_HEADER",
    "PREFILLER_HEADER",
    "Exchange",
    "ExternalProcessor",
    "Pick",
    "Picker",
    "endpoint_of",
    "epp_server",
    "kind_for_path",
    "run_epp",
]
