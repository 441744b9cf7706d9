"""The predicted residency's tests run against both implementations, as the index's do."""

from __future__ import annotations

import pytest

from router.routing.residency import PredictedResidency


def _native() -> type[PredictedResidency]:
    try:
        from native._residency import PredictedResidency as compiled
    except ImportError as exc:  # the build is part of `pip install -e .`: missing is a bug
        pytest.fail(f"the compiled residency is not built ({exc}); run `pip install -e .`")
    return compiled  # type: ignore[no-any-return]


@pytest.fixture(params=["reference", "native"])
def residency(request: pytest.FixtureRequest) -> type[PredictedResidency]:
    """``PredictedResidency`` of one implementation: the specification or its compiled twin."""
    return PredictedResidency if request.param == "reference" else _native()


@pytest.fixture(scope="session")
def compiled_residency() -> type[PredictedResidency]:
    """The compiled ``PredictedResidency``, for differential tests against the reference."""
    return _native()
