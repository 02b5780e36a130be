"""The provider service (services/provider): serving, lanes, metrics, sample locations."""
