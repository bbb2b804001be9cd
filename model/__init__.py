"""HSTU ranking model with incremental (paged KV cache) inference."""
from model.checkpoint import CheckpointError, load_checkpoint, model_fingerprint, save_checkpoint
from model.config import PRESET_NAMES, HSTUConfig, preset
from model.inference import InferenceSession, VisitResult
from model.kv_store import FullRecompute, KVStore, PagedKV
from model.recommender import HSTURecommender, ModelInputs
from model.token_layout import TokenLayout, VisitPlan
from model.visit import Visit

__all__ = [
    "PRESET_NAMES",
    "CheckpointError",
    "FullRecompute",
    "HSTUConfig",
    "HSTURecommender",
    "InferenceSession",
    "KVStore",
    "ModelInputs",
    "PagedKV",
    "TokenLayout",
    "Visit",
    "VisitPlan",
    "VisitResult",
    "load_checkpoint",
    "model_fingerprint",
    "preset",
    "save_checkpoint",
]
