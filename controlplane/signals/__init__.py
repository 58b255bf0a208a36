"""Load signals from inference servers and Envoy: parsing (and, to come, scraping and LRS)."""
