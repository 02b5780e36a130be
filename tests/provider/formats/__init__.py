"""File formats (services/provider/sources/formats): Parquet, TFRecord, MDS, litData, save_to_disk, val carving."""
