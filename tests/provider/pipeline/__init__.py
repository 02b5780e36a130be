"""Pipeline datasets (services/provider/sources/pipeline): stages, the factory, the decode cache."""
