"""The wire format: handshake, frames, messages and activation codecs (sans-IO).

Everything here turns bytes into values and values into bytes, and nothing else: no sockets, no
clocks, no Trio, no decisions (those are in `stagerun._decide`). It imports only the error
tree; tests/test_layers.py checks that. Transports and the stage server drive it with
``receive_data()`` / ``next_frame()``.
"""

from ._activations import ACTIVATION_DTYPES as ACTIVATION_DTYPES
from ._activations import ActivationDType as ActivationDType
from ._activations import activation_nbytes as activation_nbytes
from ._activations import decode_activations as decode_activations
from ._activations import encode_activations as encode_activations
from ._activations import parse_activation_dtype as parse_activation_dtype
from ._frames import DEFAULT_MAX_PAYLOAD_BYTES as DEFAULT_MAX_PAYLOAD_BYTES
from ._frames import MAX_ACTIVATION_COLS as MAX_ACTIVATION_COLS
from ._frames import MAX_HEADER_BYTES as MAX_HEADER_BYTES
from ._frames import NEED_DATA as NEED_DATA
from ._frames import PREFIX_SIZE as PREFIX_SIZE
from ._frames import Frame as Frame
from ._frames import FrameDecoder as FrameDecoder
from ._frames import decode_frame as decode_frame
from ._frames import encode_frame as encode_frame
from ._handshake import FLAG_AUTH as FLAG_AUTH
from ._handshake import HELLO_SIZE as HELLO_SIZE
from ._handshake import MAX_REFUSAL_REASON as MAX_REFUSAL_REASON
from ._handshake import NONCE_SIZE as NONCE_SIZE
from ._handshake import PROOF_SIZE as PROOF_SIZE
from ._handshake import REPLY_PREFIX_SIZE as REPLY_PREFIX_SIZE
from ._handshake import Challenge as Challenge
from ._handshake import Hello as Hello
from ._handshake import Ready as Ready
from ._handshake import ReadyDecoder as ReadyDecoder
from ._handshake import Refused as Refused
from ._handshake import Role as Role
from ._handshake import auth_proof as auth_proof
from ._handshake import decode_hello as decode_hello
from ._handshake import encode_challenge as encode_challenge
from ._handshake import encode_hello as encode_hello
from ._handshake import encode_ready as encode_ready
from ._handshake import encode_refusal as encode_refusal
from ._handshake import proofs_match as proofs_match
from ._lane import RULES as RULES
from ._lane import Owes as Owes
from ._lane import ReplyCheck as ReplyCheck
from ._lane import Rule as Rule
from ._lane import check_reply as check_reply
from ._lane import fails_upstream as fails_upstream
from ._lane import is_reply as is_reply
from ._lane import rule_for as rule_for
from ._messages import CARRIES_ACTIVATIONS as CARRIES_ACTIVATIONS
from ._messages import MAX_ERROR_MESSAGE as MAX_ERROR_MESSAGE
from ._messages import MAX_PREFIX_NAMES as MAX_PREFIX_NAMES
from ._messages import MAX_TOKENS_PER_MESSAGE as MAX_TOKENS_PER_MESSAGE
from ._messages import MAX_WINDOW_IDS as MAX_WINDOW_IDS
from ._messages import MESSAGE_TYPES as MESSAGE_TYPES
from ._messages import PREFIX_BLOCK as PREFIX_BLOCK
from ._messages import PROTOCOL_VERSION as PROTOCOL_VERSION
from ._messages import Ack as Ack
from ._messages import ActivationMessage as ActivationMessage
from ._messages import Cancel as Cancel
from ._messages import Cancelled as Cancelled
from ._messages import Configure as Configure
from ._messages import Decode as Decode
from ._messages import Error as Error
from ._messages import Message as Message
from ._messages import Predictions as Predictions
from ._messages import Prefill as Prefill
from ._messages import Probe as Probe
from ._messages import Remember as Remember
from ._messages import StageStats as StageStats
from ._messages import Stop as Stop
from ._messages import Trim as Trim
from ._messages import Verify as Verify
from ._prefix import prefix_chain as prefix_chain
from ._sampling_params import SamplingParams as SamplingParams
from ._status import MAX_STATUS_SPANS as MAX_STATUS_SPANS
from ._status import SPAN_COMPUTE as SPAN_COMPUTE
from ._status import SPAN_FIELDS as SPAN_FIELDS
from ._status import SPAN_STALE as SPAN_STALE
from ._status import PrefixStats as PrefixStats
from ._status import Status as Status
