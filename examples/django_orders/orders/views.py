"""The shop's two endpoints that enqueue a confirmation, each in the order's transaction.

Inside ``transaction.atomic()`` taskdedup writes the job's lock in the order's transaction
(the store is this database) and publishes the job once it commits. A request that fails
after the enqueue rolls back both: no order, no lock, no job.

- ``POST /orders/`` creates an order and enqueues its confirmation.
- ``POST /orders/<id>/confirmation/`` ("send my confirmation again"): a double click while the
  confirmation is still queued or being sent gets the same job (``until_executed`` per order).
"""

from __future__ import annotations

from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.http import require_POST

from .models import Order
from .tasks import send_confirmation


@require_POST
def create_order(request: HttpRequest) -> JsonResponse:
    with transaction.atomic():
        order = Order.objects.create(sku=request.POST["sku"])
        job = send_confirmation.delay(order.id)  # the lock row joins this transaction
        if request.POST.get("declined"):
            raise RuntimeError("payment declined")  # rolls back the order and the job
    return JsonResponse({"order": order.id, "job": job.id})  # (published at the commit)


@require_POST
def resend_confirmation(request: HttpRequest, order_id: int) -> JsonResponse:
    with transaction.atomic():
        order = get_object_or_404(Order, pk=order_id)
        job = send_confirmation.delay(order.id)  # a double click: the first click's job
    return JsonResponse({"order": order.id, "job": job.id, "deduplicated": job.deduplicated})
