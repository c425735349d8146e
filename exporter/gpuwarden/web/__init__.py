"""HTTP: uvicorn and its limits, the scrape and probe front, the JSON API and its docs."""
