"""Dataset sources (services/provider/sources): the source contract, files, mock and mixed sources, fields."""
