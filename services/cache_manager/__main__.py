from services.cache_manager.main import main
from shared.runner import run_service

run_service("cache_manager", main)
