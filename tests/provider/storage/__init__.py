"""Remote storage (services/provider/sources/storage): http://, s3://, gs://, az://, hf://."""
