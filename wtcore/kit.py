"""Deprecated: renamed ``wtcore.bucketed`` (CHANGELOG, 0.2.0); this alias goes in 0.3.

``wtcore-channel`` is the streamed engines' kit, so "kit" no longer said which: the bucket
engines' kit is :mod:`wtcore.bucketed`.
"""

from wtcore._moved import moved

__all__ = [  # noqa: F822 (forwarded by __getattr__)
    "BucketUpdateInfo",
    "BucketedTrainerEngine",
    "BucketedTrainerInitInfo",
    "BucketedWorkerEngine",
    "check_bucket_options",
    "renamed_fields",
]
__getattr__ = moved(__name__, "wtcore.bucketed")
